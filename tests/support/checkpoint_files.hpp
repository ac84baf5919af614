// tests/support/checkpoint_files.hpp — a scratch directory, and every file under a
// directory with its bytes, for tests that compare the files two runs write.
#pragma once
#include "shardlib/core/error.hpp"  // cat

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <system_error>

#include <unistd.h>  // getpid

namespace test_support {

// A fresh directory under the system's temporary directory, removed with its contents at scope exit.
struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(std::string_view name)
      : path(std::filesystem::temp_directory_path() / shardlib::cat("shardlib_test_", name, "_", ::getpid())) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

// Every regular file under root by its path relative to root, with its bytes.
inline std::map<std::string, std::string> files_under(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file()) {
      std::ifstream in(e.path(), std::ios::binary);
      out[std::filesystem::relative(e.path(), root).string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
  return out;
}

}  // namespace test_support
