# Fails when a sample diff in ${DOC} differs from
# `diff -u samples/${PLAIN} samples/${WRAPPED}`, or when the diff passes its
# budget: BUDGET added or BUDGET removed lines (TOTAL, when given: added +
# removed).
execute_process(COMMAND diff -u ${PLAIN} ${WRAPPED}
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
  message(FATAL_ERROR "${DOC}: the sample diff is stale; paste the output of\n"
                      "  cd samples && diff -u ${PLAIN} ${WRAPPED}\n"
                      "(without its first two lines) into the ```diff block")
endif()
# The diff budget: a user's trainer changes in about a dozen lines.
string(REGEX MATCHALL "\n\\+" added "\n${body}")
string(REGEX MATCHALL "\n-" removed "\n${body}")
list(LENGTH added n_added)
list(LENGTH removed n_removed)
if(n_added GREATER ${BUDGET} OR n_removed GREATER ${BUDGET})
  message(FATAL_ERROR "the sample diff grew to ${n_added} added and ${n_removed} removed lines "
                      "(budget: ${BUDGET} each)")
endif()
if(DEFINED TOTAL)
  math(EXPR n_changed "${n_added} + ${n_removed}")
  if(n_changed GREATER ${TOTAL})
    message(FATAL_ERROR "the sample diff changes ${n_changed} lines (budget: ${TOTAL})")
  endif()
endif()
message(STATUS "sample diff: ${n_added} lines added, ${n_removed} removed")
