// The listener of tests/support/assertion_thread_guard.cpp: an assertion on a thread other
// than the test case's ends the program naming it (ctest expects that message, see
// tests/CMakeLists.txt), for an expression assertion (reported at its start) and for one
// that reports only at its end (REQUIRE_NOTHROW).
#include <catch2/catch.hpp>

#include <thread>

TEST_CASE("an expression assertion on another thread", "[guard][expression]") {
  CHECK(true);  // the test's own thread: allowed
  std::thread([] { CHECK(1 + 1 == 2); }).join();
}

TEST_CASE("a no-throw assertion on another thread", "[guard][nothrow]") {
  std::thread([] { REQUIRE_NOTHROW([] {}()); }).join();
}
