// examples/common/flags.hpp — --name value flags for the examples (no dependency).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

namespace example {

// Flags as --name value pairs; unknown flags are an error, --help lists the known ones.
class flags {
 public:
  flags(int argc, char** argv, std::map<std::string, std::string> defaults) : values_(std::move(defaults)) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") usage(argv[0], 0);
      if (a.rfind("--", 0) != 0 || !values_.count(a.substr(2)) || i + 1 >= argc) {
        std::fprintf(stderr, "%s: unknown flag or missing value: %s\n", argv[0], a.c_str());
        usage(argv[0], 2);
      }
      values_[a.substr(2)] = argv[++i];
    }
  }
  std::string str(const std::string& k) const { return values_.at(k); }
  long num(const std::string& k) const { return std::strtol(values_.at(k).c_str(), nullptr, 10); }
  double real(const std::string& k) const { return std::strtod(values_.at(k).c_str(), nullptr); }

 private:
  [[noreturn]] void usage(const char* prog, int code) const {
    std::fprintf(code ? stderr : stdout, "usage: %s", prog);
    for (auto& [k, v] : values_) std::fprintf(code ? stderr : stdout, " [--%s %s]", k.c_str(), v.c_str());
    std::fprintf(code ? stderr : stdout, "\n");
    std::exit(code);
  }
  std::map<std::string, std::string> values_;
};

}  // namespace example
