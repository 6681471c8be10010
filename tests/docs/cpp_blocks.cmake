# Reading the ```cpp blocks of a Markdown document, shared by the scripts that check the docs
# (tests/consumer/run.cmake, tests/docs/check_quotes.cmake).

# Sets ${out} to the text of the first ```cpp block in `text`, and ${rest} to what follows it;
# ${out} is empty when there is none.
function(next_cpp_block text)
  string(FIND "${text}" "```cpp\n" start)
  if(start EQUAL -1)
    set(out "" PARENT_SCOPE)
    return()
  endif()
  math(EXPR start "${start} + 7")
  string(SUBSTRING "${text}" ${start} -1 after)
  string(FIND "${after}" "```" stop)
  if(stop EQUAL -1)
    message(FATAL_ERROR "a ```cpp block is not closed")
  endif()
  string(SUBSTRING "${after}" 0 ${stop} block)
  math(EXPR stop "${stop} + 3")
  string(SUBSTRING "${after}" ${stop} -1 after)
  set(out "${block}" PARENT_SCOPE)
  set(rest "${after}" PARENT_SCOPE)
endfunction()
