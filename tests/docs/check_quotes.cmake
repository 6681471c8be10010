# Checks that every ```cpp block of a document quotes the project's code word for word: each block,
# with runs of whitespace read as one space, must appear in one source file (core/, nn/, optim/,
# dist/, examples/, and the programs in docs/). A block whose first line is a comment starting with
# "// toy" or "// example" is the document's own code, not a quote, and is skipped.
#   cmake -DSOURCE_DIR=<project> -DDOC=docs/tape.md -P tests/docs/check_quotes.cmake
cmake_minimum_required(VERSION 3.18)
include(${CMAKE_CURRENT_LIST_DIR}/cpp_blocks.cmake)  # next_cpp_block
if(NOT SOURCE_DIR OR NOT DOC)
  message(FATAL_ERROR "usage: cmake -DSOURCE_DIR=<project> -DDOC=<doc under it> -P check_quotes.cmake")
endif()

# Runs of spaces, tabs and newlines as one space, without leading or trailing space.
function(squeeze text var)
  string(REGEX REPLACE "[ \t\r\n]+" " " text "${text}")
  string(STRIP "${text}" text)
  set(${var} "${text}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE sources
     ${SOURCE_DIR}/core/*.h ${SOURCE_DIR}/core/*.cpp ${SOURCE_DIR}/nn/*.h ${SOURCE_DIR}/nn/*.cpp
     ${SOURCE_DIR}/optim/*.h ${SOURCE_DIR}/optim/*.cpp ${SOURCE_DIR}/dist/*.h ${SOURCE_DIR}/dist/*.cpp
     ${SOURCE_DIR}/examples/*.h ${SOURCE_DIR}/examples/*.cpp ${SOURCE_DIR}/docs/*.cpp)
set(n_files 0)
foreach(f IN LISTS sources)
  file(READ ${f} text)
  squeeze("${text}" text)
  set(source_${n_files} "${text}")
  math(EXPR n_files "${n_files} + 1")
endforeach()

file(READ ${SOURCE_DIR}/${DOC} rest)
set(quoted 0)
set(skipped 0)
set(missing 0)
while(TRUE)
  next_cpp_block("${rest}")
  if(out STREQUAL "")
    break()
  endif()
  set(block "${out}")
  if(block MATCHES "^[ \t]*// (toy|example)")
    math(EXPR skipped "${skipped} + 1")
    continue()
  endif()
  math(EXPR quoted "${quoted} + 1")
  squeeze("${block}" wanted)
  set(found FALSE)
  set(i 0)
  while(i LESS n_files AND NOT found)
    string(FIND "${source_${i}}" "${wanted}" at)
    if(NOT at EQUAL -1)
      set(found TRUE)
    endif()
    math(EXPR i "${i} + 1")
  endwhile()
  if(NOT found)
    math(EXPR missing "${missing} + 1")
    message("${DOC}: this C++ block is not in the sources word for word:\n${block}\n")
  endif()
endwhile()
if(quoted EQUAL 0)
  message(FATAL_ERROR "${DOC} quotes no code (no ```cpp block outside toy and example blocks)")
endif()
if(missing GREATER 0)
  message(FATAL_ERROR "${DOC}: ${missing} of ${quoted} quoted C++ blocks are not in the sources")
endif()
message("${DOC}: all ${quoted} quoted C++ blocks are in the sources word for word (${skipped} toy or example blocks skipped)")
