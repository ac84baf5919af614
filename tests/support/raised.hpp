// tests/support/raised.hpp — what a call raised, as a value a test can assert on later.
//
// Catch is not thread-safe, so a rank inside comm::launch must not run CHECK_THROWS_WITH
// (tests/support/assertion_thread_guard.cpp aborts the program if it does). The rank keeps
// what its call raised and the test asserts after launch returns:
//
//   std::vector<std::string> errors(2);
//   comm::launch(2, [&](comm::ThreadComm& c) { errors[c.rank()] = test_support::raised([&] { ... }); });
//   for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("expected"));
#pragma once
#include <exception>
#include <string>

namespace test_support {

// The what() of the exception f() threw; "" when it returned, which no Contains(...) matches.
template <class F>
std::string raised(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
  return "";
}

}  // namespace test_support
