# Installs the build tree into a scratch prefix, then configures, builds and runs tests/consumer
# against it, as an outside project would. PROGRAM chooses the consumer's main.cpp:
#   readme (the default): the first ```cpp block of README.md, so the README's example is checked
#     to compile as written;
#   tutorial: docs/tutorial_silu.cpp, after checking that every ```cpp block of docs/tutorial.md
#     appears in it verbatim, or in the library's silu sources (core/ops/llama.cpp,
#     core/kernels/llama.h) that the tutorial sets beside it, so the tutorial quotes only code
#     that compiles and runs;
#   dist: the first ```cpp block of docs/distributed.md, built with find_package(tapegrad
#     COMPONENTS dist) (tests/dist/consumer), run alone and, when MPIEXEC is given, at 2 ranks.
cmake_minimum_required(VERSION 3.18)  # the policies of a project, in script mode too
if(NOT PROGRAM)
  set(PROGRAM readme)
endif()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR}/src)

execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()

include(${CMAKE_CURRENT_LIST_DIR}/../docs/cpp_blocks.cmake)  # next_cpp_block

# The first ```cpp block of the document `doc` (a path under SOURCE_DIR) as the consumer's main.cpp.
function(first_cpp_block_as_main doc)
  file(READ ${SOURCE_DIR}/${doc} text)
  next_cpp_block("${text}")
  if(out STREQUAL "")
    message(FATAL_ERROR "${doc} has no ```cpp block")
  endif()
  file(WRITE ${WORK_DIR}/src/main.cpp "${out}")
endfunction()

if(PROGRAM STREQUAL "readme")
  first_cpp_block_as_main(README.md)
  set(expect "tensor\\(")
elseif(PROGRAM STREQUAL "tutorial")
  file(READ ${SOURCE_DIR}/docs/tutorial.md rest)
  file(READ ${SOURCE_DIR}/docs/tutorial_silu.cpp program)
  file(READ ${SOURCE_DIR}/core/ops/llama.cpp library_op)
  file(READ ${SOURCE_DIR}/core/kernels/llama.h library_kernel)
  set(n 0)
  while(TRUE)
    next_cpp_block("${rest}")
    if(out STREQUAL "")
      break()
    endif()
    math(EXPR n "${n} + 1")
    string(FIND "${program}" "${out}" at)
    if(at EQUAL -1)
      string(FIND "${library_op}" "${out}" at)
    endif()
    if(at EQUAL -1)
      string(FIND "${library_kernel}" "${out}" at)
    endif()
    if(at EQUAL -1)
      message(FATAL_ERROR "docs/tutorial.md: C++ block ${n} does not appear verbatim in "
                          "docs/tutorial_silu.cpp, core/ops/llama.cpp or core/kernels/llama.h:\n${out}")
    endif()
  endwhile()
  if(n EQUAL 0)
    message(FATAL_ERROR "docs/tutorial.md has no ```cpp block")
  endif()
  message("docs/tutorial.md: all ${n} C++ blocks appear verbatim in docs/tutorial_silu.cpp or the library's silu")
  configure_file(${SOURCE_DIR}/docs/tutorial_silu.cpp ${WORK_DIR}/src/main.cpp COPYONLY)
  set(expect "every check passed")
elseif(PROGRAM STREQUAL "dist")
  first_cpp_block_as_main(docs/distributed.md)
  set(expect "trained by 1 process")
else()
  message(FATAL_ERROR "PROGRAM must be readme, tutorial or dist, got '${PROGRAM}'")
endif()
if(PROGRAM STREQUAL "dist")
  configure_file(${SOURCE_DIR}/tests/dist/consumer/CMakeLists.txt ${WORK_DIR}/src/CMakeLists.txt COPYONLY)
else()
  configure_file(${SOURCE_DIR}/tests/consumer/CMakeLists.txt ${WORK_DIR}/src/CMakeLists.txt COPYONLY)
endif()

execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer against the installed package failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the ${PROGRAM} program against the installed package failed")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message("${out}")
if(rc)
  message(FATAL_ERROR "the ${PROGRAM} program exited with ${rc}")
endif()
if(NOT out MATCHES "${expect}")
  message(FATAL_ERROR "the ${PROGRAM} program's output does not match '${expect}'")
endif()
if(PROGRAM STREQUAL "dist" AND MPIEXEC)  # the same program at 2 ranks (OpenMPI's flags)
  execute_process(COMMAND ${MPIEXEC} --oversubscribe --bind-to none -np 2 ${WORK_DIR}/build/consumer
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message("${out}")
  if(rc OR NOT out MATCHES "trained by 2 processes")
    message(FATAL_ERROR "the dist program at 2 ranks exited with ${rc}")
  endif()
endif()
