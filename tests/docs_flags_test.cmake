# Fails when docs/flags.md's table differs from what evenstep_flags_md prints.
execute_process(COMMAND "${FLAGS_MD}" OUTPUT_VARIABLE table RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "evenstep_flags_md failed")
endif()
file(READ "${DOC}" readme)
string(FIND "${readme}" "<!-- flags:begin -->\n${table}<!-- flags:end -->" at)
if(at EQUAL -1)
  message(FATAL_ERROR "docs/flags.md's flag table is stale; run scripts/update_docs_flags.sh\n"
                      "expected:\n${table}")
endif()
