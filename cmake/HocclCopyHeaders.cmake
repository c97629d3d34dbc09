# Copy the headers cxx generated under <CARGO_TARGET_DIR>/cxxbridge into the build's include
# dir. They are symlinks there (into OUT_DIR and the cargo registry), so they are copied by
# content; configure_file(COPYONLY) follows links and rewrites a file only when it changed,
# so consumers do not recompile after a no-op cargo build.
#   cmake -DSRC=<cargo target dir>/cxxbridge -DDST=<include dir> -P HocclCopyHeaders.cmake
if(NOT SRC OR NOT DST)
  message(FATAL_ERROR "HocclCopyHeaders: pass -DSRC=... -DDST=...")
endif()
file(GLOB_RECURSE headers RELATIVE "${SRC}" "${SRC}/*.h")
if(NOT headers)
  message(FATAL_ERROR "HocclCopyHeaders: no cxx-generated headers under ${SRC} (did cargo build run?)")
endif()
foreach(h IN LISTS headers)
  configure_file("${SRC}/${h}" "${DST}/${h}" COPYONLY)
endforeach()
