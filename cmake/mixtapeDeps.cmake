# cmake/mixtapeDeps.cmake -- finds the CPU back end's libraries (LLVM 16, oneDNN, OpenMP, and
# jemalloc and MPI for training programs) as imported targets; used by the build and by an
# installed mixtape's package config.
# LLVM's and oneDNN's own CMake packages drag in C checks, FFI and OpenCL that mixtape never
# uses, so the shared libraries and headers are found directly.
find_library(MIXTAPE_LLVM_LIBRARY NAMES LLVM-16 HINTS /usr/lib/llvm-16/lib REQUIRED)
find_path(MIXTAPE_LLVM_INCLUDE_DIR llvm/ExecutionEngine/Orc/LLJIT.h
  HINTS /usr/lib/llvm-16/include REQUIRED)
find_library(MIXTAPE_DNNL_LIBRARY NAMES dnnl REQUIRED)
find_path(MIXTAPE_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_library(MIXTAPE_JEMALLOC_LIBRARY NAMES jemalloc)
if(NOT TARGET mixtape_deps::llvm)
  add_library(mixtape_deps::llvm SHARED IMPORTED)
  set_target_properties(mixtape_deps::llvm PROPERTIES IMPORTED_LOCATION ${MIXTAPE_LLVM_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${MIXTAPE_LLVM_INCLUDE_DIR})
  add_library(mixtape_deps::dnnl SHARED IMPORTED)
  set_target_properties(mixtape_deps::dnnl PROPERTIES IMPORTED_LOCATION ${MIXTAPE_DNNL_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${MIXTAPE_DNNL_INCLUDE_DIR})
endif()
if(MIXTAPE_JEMALLOC_LIBRARY AND NOT TARGET mixtape_deps::jemalloc)
  add_library(mixtape_deps::jemalloc SHARED IMPORTED)
  set_target_properties(mixtape_deps::jemalloc PROPERTIES
    IMPORTED_LOCATION ${MIXTAPE_JEMALLOC_LIBRARY})
endif()
# MPI (Open MPI's libopenmpi-dev) for dist/'s data-parallel training; optional: a build without
# it trains in one process. -DMIXTAPE_MPI=OFF leaves it out where it is installed.
option(MIXTAPE_MPI "Data-parallel training over MPI (dist/)" ON)
if(MIXTAPE_MPI)
  # The C API from C++ (the project enables no C): MPI-2's C++ bindings are left out.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
endif()
