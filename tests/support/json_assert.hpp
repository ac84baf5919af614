// tests/support/json_assert.hpp — included first in every test program's C++ (see
// tests/CMakeLists.txt): nlohmann::json checks its preconditions with JSON_ASSERT, an
// assert that Release's NDEBUG drops, so that a misuse (operator[] on a missing key of a
// const object reads past the map's end) would pass unseen. Here it traps instead.
#pragma once
#define JSON_ASSERT(x) ((x) ? static_cast<void>(0) : __builtin_trap())
