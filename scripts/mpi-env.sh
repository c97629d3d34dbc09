# shellcheck shell=bash
# Open MPI settings for single-host runs (tests, the demo), as root and inside containers.
# Source it: `source scripts/mpi-env.sh`, then run `"${HOCCL_MPIRUN[@]}" -np 4 prog`.
# Any variable already set in the environment wins, so a cluster setup can override all.
# Multi-host jobs need their own settings instead (btl/oob on the real network, ssh).

# Open MPI refuses to run as root unless told twice.
export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT:-1}"
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
# More ranks than cores (same as --oversubscribe); ranks share cores with proxy threads, so
# do not pin each rank to one core.
export OMPI_MCA_rmaps_base_oversubscribe="${OMPI_MCA_rmaps_base_oversubscribe:-1}"
export OMPI_MCA_hwloc_base_binding_policy="${OMPI_MCA_hwloc_base_binding_policy:-none}"
# One host: shared memory and loopback only.
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
export OMPI_MCA_pml="${OMPI_MCA_pml:-ob1}"
export OMPI_MCA_oob_tcp_if_include="${OMPI_MCA_oob_tcp_if_include:-lo}"
# CMA single-copy needs ptrace rights that containers usually lack.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
# Without ssh/rsh, mpirun's launcher fails before starting even local ranks.
if ! command -v ssh >/dev/null 2>&1 && ! command -v rsh >/dev/null 2>&1; then
  export OMPI_MCA_plm="${OMPI_MCA_plm:-isolated}"
fi
# shellcheck disable=SC2034  # used by the scripts that source this file
HOCCL_MPIRUN=(mpirun --oversubscribe)
