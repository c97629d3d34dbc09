// spawn_ranks.h for the C++ checks: the make_id_fn that gives the ranks a fresh
// hoccl::UniqueId.
#pragma once

#include <cstdio>
#include <cstring>

#include "hoccl/hoccl.hpp"
#include "spawn_ranks.h"

// spawn_ranks's makeId: writes a fresh hoccl::UniqueId to `id`; `program` (a C string, the
// spawn_ranks argument) prefixes the message of a failure.
inline int makeUniqueId(void* id, void* program) {
  try {
    hoccl::UniqueId u = hoccl::UniqueId::create();
    std::memcpy(id, u.bytes.data(), u.bytes.size());
    return 0;
  } catch (const hoccl::Error& e) {
    std::fprintf(stderr, "%s: UniqueId::create: %s\n", static_cast<const char*>(program), e.what());
    return 1;
  }
}
