# Fails when the sample diff in docs/usage.md differs from
# `diff -u samples/train_fortunes_plain.cc samples/train_fortunes.cc`, or when the
# diff passes its budget of 20 added or 20 removed lines.
execute_process(COMMAND diff -u train_fortunes_plain.cc train_fortunes.cc
  WORKING_DIRECTORY "${SAMPLES}" OUTPUT_VARIABLE diff)
# Drop the two header lines (file names and dates): the body starts at "@@".
string(FIND "${diff}" "\n@@" at)
if(at EQUAL -1)
  message(FATAL_ERROR "no diff between the two trainers?")
endif()
math(EXPR at "${at} + 1")
string(SUBSTRING "${diff}" ${at} -1 body)
file(READ "${DOC}" readme)
string(FIND "${readme}" "```diff\n${body}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "docs/usage.md's sample diff is stale; paste the output of\n"
                      "  cd samples && diff -u train_fortunes_plain.cc train_fortunes.cc\n"
                      "(without its first two lines) into the ```diff block")
endif()
# The diff budget: a user's trainer changes in about a dozen lines.
string(REGEX MATCHALL "\n\\+" added "\n${body}")
string(REGEX MATCHALL "\n-" removed "\n${body}")
list(LENGTH added n_added)
list(LENGTH removed n_removed)
if(n_added GREATER 20 OR n_removed GREATER 20)
  message(FATAL_ERROR "the sample diff grew to ${n_added} added and ${n_removed} removed lines "
                      "(budget: 20 each)")
endif()
message(STATUS "sample diff: ${n_added} lines added, ${n_removed} removed")
