//! MPI bootstrap (rsmpi). Filled in by the bootstrap work.
