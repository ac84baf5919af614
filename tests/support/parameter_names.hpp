// tests/support/parameter_names.hpp — a layer's parameter names in visiting order.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace test_support {

template <class L>
std::vector<std::string> parameter_names(L& layer) {
  std::vector<std::string> names;
  layer.parameters([&](std::string_view name, auto&) { names.emplace_back(name); });
  return names;
}

}  // namespace test_support
