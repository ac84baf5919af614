// tests/support/assertion_thread_guard.cpp — fails a test program whose Catch assertion runs
// on a thread other than the test case's.
//
// Catch2 v2 is not thread-safe: an assertion on a rank's thread (inside comm::launch) races
// with the others over Catch's counters, last-assertion record and message stack, which shows
// as assertion counts that vary between runs or as a lost failure. The ranks hand their values
// out of launch and the test asserts after it returns. This listener enforces that: at the first
// assertion made elsewhere it prints where and ends the program with status 3 (a failed ctest
// test), since nothing Catch does from that thread can be trusted. It checks at assertionStarting (every
// expression assertion) and assertionEnded (the others, such as REQUIRE_THROWS, that report
// without starting).
#define CATCH_CONFIG_EXTERNAL_INTERFACES
#include <catch2/catch.hpp>

#include <cstdio>   // std::fflush, std::fprintf
#include <cstdlib>  // std::_Exit
#include <mutex>    // std::mutex
#include <thread>   // std::this_thread

namespace {

class assertion_thread_guard : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  // Written before the test case starts any thread (thread creation orders it before their reads).
  void testCaseStarting(Catch::TestCaseInfo const& info) override {
    test_thread_ = std::this_thread::get_id();
    TestEventListenerBase::testCaseStarting(info);
  }
  void sectionStarting(Catch::SectionInfo const& info) override {
    check(info.lineInfo, "SECTION");
    TestEventListenerBase::sectionStarting(info);
  }
  void assertionStarting(Catch::AssertionInfo const& info) override { check(info.lineInfo, info.macroName); }
  bool assertionEnded(Catch::AssertionStats const& stats) override {
    check(stats.assertionResult.getSourceInfo(), stats.assertionResult.getTestMacroName());
    return true;
  }

 private:
  void check(Catch::SourceLineInfo const& where, Catch::StringRef macro) const {
    if (std::this_thread::get_id() == test_thread_) return;
    static std::mutex first;  // one report: another thread that gets here waits for the exit
    first.lock();
    std::fprintf(stderr,
                 "%s:%zu: %.*s ran on a thread other than the test case's: Catch is not thread-safe. Keep the "
                 "ranks' values and assert after comm::launch returns.\n",
                 where.file, where.line, static_cast<int>(macro.size()), macro.data());
    std::fflush(stderr);
    std::_Exit(3);  // not exit(): the test's own thread is still inside Catch
  }
  std::thread::id test_thread_ = std::this_thread::get_id();
};

}  // namespace

CATCH_REGISTER_LISTENER(assertion_thread_guard)
