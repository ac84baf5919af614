// shardlib/core/glob.hpp — glob_match: the patterns that pick parameters by dotted name
// (optim::match_names, nn::freeze).
#pragma once
#include "shardlib/config.hpp"

#include <cstddef>      // std::size_t
#include <string_view>  // std::string_view

namespace shardlib {

// '*' matches any run of characters (dots included), anything else itself:
// glob_match("transformer.h.*.attn.*", "transformer.h.0.attn.c_attn.weight").
inline bool glob_match(std::string_view pattern, std::string_view s) {
  std::size_t p = 0, i = 0, star = std::string_view::npos, from = 0;
  while (i < s.size()) {
    if (p < pattern.size() && pattern[p] != '*' && pattern[p] == s[i]) {
      ++p, ++i;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++, from = i;
    } else if (star != std::string_view::npos) {
      p = star + 1, i = ++from;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace shardlib
