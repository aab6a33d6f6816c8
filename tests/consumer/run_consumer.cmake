# tests/consumer/run_consumer.cmake -- installs mixtape into a scratch prefix and builds and runs a
# separate project that finds it with find_package(mixtape).
set(prefix ${BINARY_DIR}/consumer_install)
set(build ${BINARY_DIR}/consumer_build)
file(REMOVE_RECURSE ${prefix} ${build})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${prefix}
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
set(flags "")
if(SANITIZE)
  set(flags "-fsanitize=address,undefined")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${build}
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_FLAGS=${flags} -DCMAKE_EXE_LINKER_FLAGS=${flags}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer project failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${build} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer project failed: ${rc}")
endif()
# Executing a just-linked binary can fail with ETXTBSY while some process forked during the link
# still holds its write descriptor (seen once under a loaded machine): retry briefly.
foreach(attempt RANGE 5)
  execute_process(COMMAND ${build}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc STREQUAL "Text file busy")
    break()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E sleep 1)
endforeach()
message(STATUS "${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok")
  message(FATAL_ERROR "the consumer program failed: ${rc}")
endif()
