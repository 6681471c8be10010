# Bad command lines give a one-line error on stderr and exit code 2.
function(expect_error)
  execute_process(COMMAND ${TRAIN_LM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(STRIP "${err}" err)
  string(FIND "${err}" "\n" newline)
  if(NOT rc EQUAL 2 OR NOT newline EQUAL -1 OR NOT err MATCHES "^train_lm: error: ")
    message(FATAL_ERROR "train_lm ${ARGN}: expected one error line and exit code 2, got exit ${rc} and:\n${err}")
  endif()
  message(STATUS "train_lm ${ARGN} -> ${err}")
endfunction()

# As expect_error, and the line must contain `says` (the flag or file, and the reason).
function(expect_error_says says)
  execute_process(COMMAND ${TRAIN_LM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(STRIP "${err}" err)
  string(FIND "${err}" "\n" newline)
  string(FIND "${err}" "${says}" at)
  if(NOT rc EQUAL 2 OR NOT newline EQUAL -1 OR NOT err MATCHES "^train_lm: error: " OR at EQUAL -1)
    message(FATAL_ERROR "train_lm ${ARGN}: expected one error line with '${says}' and exit code 2, got exit ${rc} and:\n${err}")
  endif()
  message(STATUS "train_lm ${ARGN} -> ${err}")
endfunction()

file(WRITE ${WORK_DIR}/ok.txt "")
foreach(i RANGE 60)
  file(APPEND ${WORK_DIR}/ok.txt "a small corpus of text for the command line test, line ${i}\n")
endforeach()
expect_error(--data ${WORK_DIR}/ok.txt --norm foo)
expect_error(--data ${WORK_DIR}/ok.txt --p 0)
expect_error(--data ${WORK_DIR}/ok.txt --steps -1)
expect_error(--data ${WORK_DIR}/missing.txt)
expect_error(--data ${WORK_DIR}/ok.txt --n-embd 30 --n-head 4)
expect_error(--data ${WORK_DIR}/ok.txt --threads 0)
expect_error(--data ${WORK_DIR}/ok.txt --bogus-flag)
expect_error(--data ${WORK_DIR}/ok.txt --lr abc)
expect_error(--data ${WORK_DIR}/ok.txt --dropout 1)
expect_error(--data ${WORK_DIR}/ok.txt --resume ${WORK_DIR}/nowhere)
expect_error(--data ${WORK_DIR}/ok.txt --arch bert)
expect_error(--data ${WORK_DIR}/ok.txt --arch llama --n-embd 12 --n-head 4)

# A finished run samples without training, from its prompt; a prompt the vocabulary cannot spell
# is one error line.
set(run ${WORK_DIR}/finished_llama)
file(REMOVE_RECURSE ${run})
execute_process(COMMAND ${TRAIN_LM} --data ${WORK_DIR}/ok.txt --arch llama --steps 3 --n-layer 1 --n-embd 16
                        --n-head 2 --block-size 8 --batch-size 2 --eval-iters 1 --quiet --out ${run}
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training the small llama failed (${rc}): ${err}")
endif()
file(TIMESTAMP ${run}/checkpoint.safetensors before)
execute_process(COMMAND ${TRAIN_LM} --resume ${run} --sample 20 --prompt "a small"
                RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
file(TIMESTAMP ${run}/checkpoint.safetensors after)
string(LENGTH "${text}" n)
if(NOT rc EQUAL 0 OR NOT text MATCHES "^a small" OR n LESS 27 OR NOT before STREQUAL after)
  message(FATAL_ERROR "--resume --sample --prompt: exit ${rc}, ${n} characters '${text}', checkpoint ${before} -> ${after}: ${err}")
endif()
message(STATUS "train_lm --resume ${run} --sample 20 --prompt 'a small' -> ${text}")
expect_error(--resume ${run} --sample 20 --prompt "ROMEO")

# Without --prompt, a finished run's sample starts from the corpus's first character, as the run's
# samples.txt does after its first line (which names the step the sample was drawn at): the same
# text, also from a corpus that has no newline, and also when the corpus is gone (the checkpoint
# records the first character) or moved.
file(READ ${WORK_DIR}/ok.txt ok_text)
string(REPLACE "\n" " " one_line "${ok_text}")
file(WRITE ${WORK_DIR}/one_line.txt "${one_line}")
file(REMOVE ${WORK_DIR}/one_line_moved.txt)
set(flat ${WORK_DIR}/finished_one_line)
file(REMOVE_RECURSE ${flat})
execute_process(COMMAND ${TRAIN_LM} --data ${WORK_DIR}/one_line.txt --steps 3 --n-layer 1 --n-embd 16 --n-head 2
                        --block-size 8 --batch-size 2 --eval-iters 1 --sample 20 --quiet --out ${flat}
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training on one line failed (${rc}): ${err}")
endif()
file(READ ${flat}/samples.txt drawn)
string(FIND "${drawn}" "\n" eol)
string(SUBSTRING "${drawn}" 0 ${eol} head)
math(EXPR eol "${eol} + 1")
string(SUBSTRING "${drawn}" ${eol} -1 expected)
if(NOT head STREQUAL "step 3 (temperature 0.8, top-k 40)")
  message(FATAL_ERROR "samples.txt starts with '${head}', not the step it was drawn at")
endif()
execute_process(COMMAND ${TRAIN_LM} --resume ${flat} --sample 20 RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT text STREQUAL expected)
  message(FATAL_ERROR "--resume --sample without --prompt: exit ${rc}, '${text}', samples.txt '${expected}': ${err}")
endif()
file(RENAME ${WORK_DIR}/one_line.txt ${WORK_DIR}/one_line_moved.txt)
execute_process(COMMAND ${TRAIN_LM} --resume ${flat} --sample 20 RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT text STREQUAL expected)
  message(FATAL_ERROR "--resume --sample (corpus gone): exit ${rc}, '${text}', samples.txt '${expected}': ${err}")
endif()
execute_process(COMMAND ${TRAIN_LM} --resume ${flat} --data ${WORK_DIR}/one_line_moved.txt --sample 20
                RESULT_VARIABLE rc OUTPUT_VARIABLE text ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT text STREQUAL expected)
  message(FATAL_ERROR "--resume --data (moved) --sample: exit ${rc}, '${text}', samples.txt '${expected}': ${err}")
endif()

# Unclear inputs of earlier versions: each is one line naming the flag or file and the reason.
expect_error_says("data: '${WORK_DIR}' is a directory" --data ${WORK_DIR})
expect_error_says("data: '/dev/zero' is not a regular file" --data /dev/zero)
expect_error_says("--lr: must be a finite number >= 0, got inf" --data ${WORK_DIR}/ok.txt --lr inf)
expect_error_says("--min-lr: 0.01 is above --lr 0.001" --data ${WORK_DIR}/ok.txt --min-lr 0.01)
expect_error_says("--temperature: must be a finite number > 0, got inf" --data ${WORK_DIR}/ok.txt --temperature inf)
# Out-of-range values that were accepted quietly (-5 taken as the default, seeds saturating,
# threads cut to 64).
expect_error_says("--lr-decay-iters: must be >= 0, got -5" --data ${WORK_DIR}/ok.txt --lr-decay-iters -5)
expect_error_says("--seed: must be an integer in [0, 18446744073709551615], got -1" --data ${WORK_DIR}/ok.txt --seed -1)
expect_error_says("--seed: must be an integer in [0, 18446744073709551615], got 99999999999999999999"
                  --data ${WORK_DIR}/ok.txt --seed 99999999999999999999)
expect_error_says("--threads: must be in [1, 64], got 9999" --data ${WORK_DIR}/ok.txt --threads 9999)
expect_error_says("--overwrite: starts a new run; not with --resume" --resume ${run} --overwrite)
expect_error_says("--out: not with --resume" --resume ${run} --out ${run})

# A directory that holds a run is not overwritten by a new run into it.
expect_error_says("--out: '${run}' already holds a run (checkpoint.safetensors); continue it with --resume ${run}"
                  --data ${WORK_DIR}/ok.txt --steps 3 --out ${run})
# A resume names what differs from the run, every flag.
expect_error_says("--arch gpt (the run's: llama), --n-embd 32 (the run's: 16)" --resume ${run} --arch gpt --n-embd 32)

# A corpus whose vocabulary changed since the run started: said as such, not as a tensor's shape.
set(vocab_run ${WORK_DIR}/vocab_run)
file(REMOVE_RECURSE ${vocab_run})
file(COPY_FILE ${WORK_DIR}/ok.txt ${WORK_DIR}/changing.txt)
execute_process(COMMAND ${TRAIN_LM} --data ${WORK_DIR}/changing.txt --steps 3 --n-layer 1 --n-embd 16 --n-head 2
                        --block-size 8 --batch-size 2 --eval-iters 1 --quiet --out ${vocab_run}
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "training the small gpt failed (${rc}): ${err}")
endif()
file(APPEND ${WORK_DIR}/changing.txt "QXZ!\n")
expect_error_says("has another vocabulary" --resume ${vocab_run} --steps 6)

# --trace --out writes tape.dot whole or says why not: a write that fails (the file size limit, as
# a full disk) is one error line, not a claim of a file left empty.
set(trace_dir ${WORK_DIR}/trace_no_space)
file(REMOVE_RECURSE ${trace_dir})
execute_process(COMMAND sh -c "trap '' XFSZ; ulimit -f 0; exec \"$0\" \"$@\"" ${TRAIN_LM} --data ${WORK_DIR}/ok.txt
                        --n-layer 1 --n-embd 16 --n-head 2 --block-size 8 --batch-size 2 --trace --out ${trace_dir}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(STRIP "${err}" err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "^train_lm: error: write_file_atomic: .*tape.dot.*File too large$" OR out MATCHES "Graphviz:"
   OR EXISTS ${trace_dir}/tape.dot)
  message(FATAL_ERROR "--trace --out with no room: expected exit 2 and one line naming tape.dot, got exit ${rc}:\n${err}")
endif()
message(STATUS "train_lm --trace --out (no room) -> ${err}")

# A run of 0 steps leaves a step-0 checkpoint: its directory resumes as the error of a second --out
# advises (finished at step 0; --steps N continues it), and continuing it trains the same weights
# as a fresh run of N steps (the logged losses, bit for bit).
set(zero ${WORK_DIR}/zero_steps)
set(fresh ${WORK_DIR}/three_steps)
file(REMOVE_RECURSE ${zero} ${fresh})
set(small --data ${WORK_DIR}/ok.txt --n-layer 1 --n-embd 16 --n-head 2 --block-size 8 --batch-size 2 --eval-iters 1 --quiet)
execute_process(COMMAND ${TRAIN_LM} ${small} --steps 0 --out ${zero} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT EXISTS ${zero}/checkpoint.safetensors)
  message(FATAL_ERROR "--steps 0 --out: exit ${rc}, checkpoint.safetensors written: no: ${err}")
endif()
expect_error_says("--resume" ${small} --steps 0 --out ${zero})
execute_process(COMMAND ${TRAIN_LM} --resume ${zero} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT "${out}${err}" MATCHES "finished \\(step 0 reached\\)")
  message(FATAL_ERROR "--resume of a 0-step run: exit ${rc}: ${out}${err}")
endif()
execute_process(COMMAND ${TRAIN_LM} --resume ${zero} --steps 3 RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
execute_process(COMMAND ${TRAIN_LM} ${small} --steps 3 --out ${fresh} RESULT_VARIABLE rc2 OUTPUT_QUIET ERROR_VARIABLE err2)
if(NOT rc EQUAL 0 OR NOT rc2 EQUAL 0)
  message(FATAL_ERROR "continuing the 0-step run: exit ${rc} (${err}); the fresh 3-step run: exit ${rc2} (${err2})")
endif()
foreach(dir ${zero} ${fresh})
  file(STRINGS ${dir}/train_log.csv rows)
  set(losses "")
  foreach(row IN LISTS rows)
    if(row MATCHES "^([0-9]+),([^,]+),")
      list(APPEND losses "${CMAKE_MATCH_1}:${CMAKE_MATCH_2}")
    endif()
  endforeach()
  set(losses_${dir} "${losses}")
endforeach()
list(LENGTH losses_${fresh} n)
if(NOT n EQUAL 3 OR NOT "${losses_${zero}}" STREQUAL "${losses_${fresh}}")
  message(FATAL_ERROR "a 0-step run continued to 3 steps logged ${losses_${zero}}; a fresh 3-step run ${losses_${fresh}}")
endif()
message(STATUS "a 0-step run resumes, and continued to 3 steps logs the fresh run's losses: ${losses_${zero}}")
