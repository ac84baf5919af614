// tests/support/gradcheck.hpp — finite-difference gradient checks in double precision.
#pragma once
#include "shardlib/core/random.hpp"
#include "shardlib/core/tensor.hpp"
#include "shardlib/nn/context.hpp"
#include "shardlib/nn/layer.hpp"
#include "shardlib/nn/replicated.hpp"
#include "support/compare.hpp"

#include <cmath>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace gradcheck {

using namespace shardlib;

struct result {
  std::string worst;  // the parameter (or "input") with the largest error
  double max_rel_error = 0;
  int compared = 0;
};

inline Tensor<double> random_tensor(Shape s, std::uint64_t stream, double scale = 1.0) {
  Tensor<double> t(s);
  counter_rng rng(12345, stream);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = scale * (2 * rng.uniform_double(std::uint64_t(i)) - 1);
  return t;
}

// Norm-wise relative error ||analytic - numeric|| / max(||analytic||, ||numeric||):
// central differences with step h = 1e-6 in double carry an error of about
// h^2 |f'''| + eps |f| / h ~ 1e-10 relative, far below the 1e-6 bound.
// NaN when either side holds a NaN, so no bound admits it.
inline double rel_error(const std::vector<double>& a, const std::vector<double>& n) {
  double d = 0, na = 0, nn = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - n[i]) * (a[i] - n[i]);
    na += a[i] * a[i];
    nn += n[i] * n[i];
  }
  const double scale = std::sqrt(test_support::max_keeping_nan(na, nn));
  return scale == 0 ? 0 : std::sqrt(d) / scale;
}

// Loss = sum(y * r) for a fixed random r, so dL/dy = r. Compares backward's
// parameter gradients (and dL/dx for floating inputs) with central differences
// on at most `per_param` elements of each parameter.
template <nn::Layer L>
result check(L& layer, const typename L::input& x, int per_param = 40, std::uint64_t seed = 7) {
  nn::Replicated<double, L> owner(layer, seed);
  nn::context ctx;
  auto loss = [&](const typename L::input& in, const Tensor<double>& r) {
    ctx.set_step(0);  // the same dropout masks on every evaluation
    auto y = ctx.forward(layer, in);
    double s = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) s += y[i] * r[i];
    return s;
  };
  ctx.set_step(0);
  auto y = ctx.forward(layer, x);
  auto r = random_tensor(y.shape(), 99);
  owner.zero_grad();
  auto dx = ctx.backward(layer, r);

  result res;
  auto record = [&](const std::string& what, const std::vector<double>& a, const std::vector<double>& n) {
    double e = rel_error(a, n);
    if (std::isnan(e)) e = test_support::infinity;  // the `>=` below would skip a NaN
    res.compared += int(a.size());
    if (e >= res.max_rel_error) res.max_rel_error = e, res.worst = what;
  };
  // Central differences of the loss in `values` at every stride-th element,
  // beside the analytic gradient `grads` there.
  const double h = 1e-6;
  auto compare = [&](const std::string& what, std::span<double> values, std::span<const double> grads,
                     std::size_t samples) {
    std::vector<double> a, n;
    const std::size_t stride = std::max<std::size_t>(1, values.size() / samples);
    for (std::size_t j = 0; j < values.size(); j += stride) {
      const double keep = values[j];
      values[j] = keep + h;
      const double up = loss(x, r);
      values[j] = keep - h;
      const double down = loss(x, r);
      values[j] = keep;
      a.push_back(grads[j]);
      n.push_back((up - down) / (2 * h));
    }
    record(what, a, n);
  };
  for (const auto& e : owner.layout().entries) compare(e.name, owner.value(e.name), owner.grad(e.name), per_param);
  if constexpr (std::is_same_v<typename L::input, Tensor<double>>) compare("input", x.span(), dx.span(), 4 * per_param);
  return res;
}

}  // namespace gradcheck
