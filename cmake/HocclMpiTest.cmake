# hoccl_add_mpi_test(NAME PROGRAM [ARGS...]): the CTest tests NAME.np2 and NAME.np4, which run
# PROGRAM under mpirun through ctest/mpirun.sh (the repository's single-host Open MPI
# settings) with label `mpi`. Pass or fail is the exit code (never PASS_REGULAR_EXPRESSION,
# which makes CTest ignore it).
set(HOCCL_MPIRUN_WRAPPER "${CMAKE_CURRENT_LIST_DIR}/../ctest/mpirun.sh")
function(hoccl_add_mpi_test name program)
  foreach(np 2 4)
    add_test(NAME ${name}.np${np} COMMAND bash "${HOCCL_MPIRUN_WRAPPER}" ${np} ${program} ${ARGN})
    set_tests_properties(${name}.np${np} PROPERTIES LABELS mpi TIMEOUT 300)
  endforeach()
endfunction()
