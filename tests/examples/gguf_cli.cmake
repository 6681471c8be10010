# train_lm's GGUF commands: --resume DIR --export-gguf FILE [--gguf-dtype], --init-from FILE.gguf.
#   - a llama RMSNorm run exports (F32 and BF16), and a new run started from the F32 file
#     (--init-from, --steps 0) has the same logits to the bit (dump_logits' output files are equal);
#     likewise a BPE run (--tokenizer bpe), started again with its tokenizer.json; the BPE file
#     with the character tokens of the same corpus is refused;
#   - pRMSNorm, BatchNorm, none, a LayerNorm llama and the gpt arch are refused with one line and
#     exit code 2, and nothing is left in the output directory;
#   - misused options and a corpus of another vocabulary are one error line and exit code 2.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/out)
file(WRITE ${WORK_DIR}/ok.txt "")
foreach(i RANGE 60)
  file(APPEND ${WORK_DIR}/ok.txt "a small corpus of text for the GGUF test, line ${i}\n")
endforeach()
file(WRITE ${WORK_DIR}/other.txt "")
foreach(i RANGE 60)
  file(APPEND ${WORK_DIR}/other.txt "QUITE ANOTHER VOCABULARY ${i}\n")
endforeach()
set(tiny --data ${WORK_DIR}/ok.txt --n-layer 1 --n-embd 16 --n-head 2 --block-size 8 --batch-size 2 --eval-iters 1 --quiet)

function(train dir)
  execute_process(COMMAND ${TRAIN_LM} ${tiny} --steps 3 --out ${WORK_DIR}/${dir} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_lm ${ARGN} --out ${dir} failed (${rc}): ${err}")
  endif()
endfunction()

function(expect_ok)
  execute_process(COMMAND ${TRAIN_LM} ${ARGN} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_lm ${ARGN} failed (${rc}): ${err}")
  endif()
  message(STATUS "train_lm ${ARGN} -> ok")
endfunction()

# One error line on stderr, exit code 2, and out/ still empty (no file, no temporary file). A run
# that reads its corpus first says so on a line of its own: LAST_LINE checks the last line only.
function(expect_refusal pattern)
  execute_process(COMMAND ${TRAIN_LM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(STRIP "${err}" err)
  if(LAST_LINE)
    string(REGEX REPLACE "^.*\n" "" err "${err}")
  endif()
  string(FIND "${err}" "\n" newline)
  file(GLOB left ${WORK_DIR}/out/*)
  if(NOT rc EQUAL 2 OR NOT newline EQUAL -1 OR NOT err MATCHES "^train_lm: error: .*${pattern}" OR left)
    message(FATAL_ERROR "train_lm ${ARGN}: expected one error line matching '${pattern}', exit 2 and nothing written; "
                        "got exit ${rc}, files '${left}' and:\n${err}")
  endif()
  message(STATUS "train_lm ${ARGN} -> ${err}")
endfunction()

# Export and round trip.
train(llama --arch llama --norm rmsnorm)
expect_ok(--resume ${WORK_DIR}/llama --export-gguf ${WORK_DIR}/llama.gguf)
expect_ok(--resume ${WORK_DIR}/llama --export-gguf ${WORK_DIR}/llama_bf16.gguf --gguf-dtype bf16)
expect_ok(${tiny} --init-from ${WORK_DIR}/llama.gguf --steps 0 --out ${WORK_DIR}/from_gguf)
expect_ok(${tiny} --init-from ${WORK_DIR}/llama_bf16.gguf --steps 2 --out ${WORK_DIR}/from_bf16)
foreach(run llama from_gguf from_bf16)
  execute_process(COMMAND ${DUMP_LOGITS} ${WORK_DIR}/${run}/model.safetensors 3,1,4,1,5,9,2,6 ${WORK_DIR}/${run}.logits
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "dump_logits ${run}: ${err}")
  endif()
endforeach()
file(SHA256 ${WORK_DIR}/llama.logits before)
file(SHA256 ${WORK_DIR}/from_gguf.logits after)
file(SHA256 ${WORK_DIR}/from_bf16.logits rounded)
if(NOT before STREQUAL after OR before STREQUAL rounded)
  message(FATAL_ERROR "--init-from: the F32 round trip must give the same logits bit for bit (${before} vs ${after}), "
                      "the BF16 one other logits (${rounded})")
endif()
message(STATUS "--init-from llama.gguf: logits equal bit for bit")

# A BPE run: its tokens and merges are written, and a run with the same tokenizer starts from the file.
train(bpe --arch llama --norm rmsnorm --tokenizer bpe --vocab-size 270)
expect_ok(--resume ${WORK_DIR}/bpe --export-gguf ${WORK_DIR}/bpe.gguf)
expect_ok(${tiny} --init-from ${WORK_DIR}/bpe.gguf --tokenizer ${WORK_DIR}/bpe/tokenizer.json --steps 0
          --out ${WORK_DIR}/from_bpe)
foreach(run bpe from_bpe)
  execute_process(COMMAND ${DUMP_LOGITS} ${WORK_DIR}/${run}/model.safetensors 3,1,4,1,5,9,265,269 ${WORK_DIR}/${run}.logits
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "dump_logits ${run}: ${err}")
  endif()
endforeach()
file(SHA256 ${WORK_DIR}/bpe.logits before)
file(SHA256 ${WORK_DIR}/from_bpe.logits after)
if(NOT before STREQUAL after)
  message(FATAL_ERROR "--init-from bpe.gguf: the logits differ (${before} vs ${after})")
endif()
message(STATUS "--init-from bpe.gguf: logits equal bit for bit")
set(LAST_LINE ON)
expect_refusal("different vocabulary.*characters against a BPE of 270 tokens and 14 merges" ${tiny} --init-from ${WORK_DIR}/bpe.gguf)
set(LAST_LINE OFF)

# Refusals: nothing llama.cpp cannot run is written.
foreach(case "prmsnorm;partial RMSNorm" "batchnorm;no BatchNorm" "none;always normalises" "layernorm;LayerNorm llama")
  list(GET case 0 norm)
  list(GET case 1 why)
  train(${norm} --arch llama --norm ${norm})
  expect_refusal("${why}" --resume ${WORK_DIR}/${norm} --export-gguf ${WORK_DIR}/out/${norm}.gguf)
endforeach()
train(gpt --arch gpt --norm rmsnorm)
expect_refusal("gpt arch" --resume ${WORK_DIR}/gpt --export-gguf ${WORK_DIR}/out/gpt.gguf)

# Misused options.
expect_refusal("needs --resume" ${tiny} --export-gguf ${WORK_DIR}/out/x.gguf)
expect_refusal("applies to --export-gguf only" ${tiny} --gguf-dtype bf16)
expect_refusal("not with --resume" --resume ${WORK_DIR}/llama --init-from ${WORK_DIR}/llama.gguf)
# The file defines the model: a model flag with another value is refused, not quietly replaced.
expect_refusal("--init-from: the model is the one in '.*llama.gguf'; these flags differ from it: --arch gpt \\(the file's: llama\\), --n-embd 32 \\(the file's: 16\\), --block-size 16 \\(the file's: 8\\)"
               ${tiny} --arch gpt --n-embd 32 --block-size 16 --init-from ${WORK_DIR}/llama.gguf --out ${WORK_DIR}/out/flags)
expect_refusal("not with --compare" ${tiny} --compare --init-from ${WORK_DIR}/llama.gguf)
expect_refusal("cannot open" ${tiny} --init-from ${WORK_DIR}/missing.gguf)
expect_refusal("not a GGUF file" ${tiny} --init-from ${WORK_DIR}/ok.txt)
set(LAST_LINE ON)
expect_refusal("different vocabulary" ${tiny} --data ${WORK_DIR}/other.txt --init-from ${WORK_DIR}/llama.gguf)
set(LAST_LINE OFF)
expect_refusal("gguf-dtype" --resume ${WORK_DIR}/llama --export-gguf ${WORK_DIR}/out/x.gguf --gguf-dtype f16)
