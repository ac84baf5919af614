// libFuzzer target: safetensors::parse must either raise shardlib::io_error or return a
// file whose tensors tile the data section and read back at their declared sizes.
#include "shardlib/io/safetensors.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>  // std::abort
#include <cstring>  // std::memcpy, std::memcmp
#include <vector>

namespace {

using namespace shardlib;

// Reads tensor t through get<T> for its element type; BOOL bytes other than 0/1 throw io_error.
std::size_t elements(const io::safetensors& f, const io::tensor_info& t) {
  switch (t.type) {
    case dtype::f64: return f.get<double>(t.name).size();
    case dtype::f32: return f.get<float>(t.name).size();
    case dtype::f16: return f.get<half>(t.name).size();
    case dtype::bf16: return f.get<bfloat16>(t.name).size();
    case dtype::i64: return f.get<std::int64_t>(t.name).size();
    case dtype::i32: return f.get<std::int32_t>(t.name).size();
    case dtype::i16: return f.get<std::int16_t>(t.name).size();
    case dtype::i8: return f.get<std::int8_t>(t.name).size();
    case dtype::u8: return f.get<std::uint8_t>(t.name).size();
    case dtype::boolean: return f.get<bool>(t.name).size();
  }
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(size);
  if (size != 0) std::memcpy(bytes.data(), data, size);
  try {
    const auto f = io::safetensors::parse(bytes, "fuzz");
    std::uint64_t header = 0;
    std::memcpy(&header, data, sizeof header);  // parse accepted, so there are 8 bytes
    std::uint64_t covered = 0;
    for (const auto& t : f.tensors()) {
      const auto b = f.bytes(t.name);
      const auto numel = static_cast<std::uint64_t>(t.shape.numel());
      if (t.begin != covered || b.size() != t.end - t.begin || b.size() != numel * size_of(t.type)) std::abort();
      if (b.size() != 0 && std::memcmp(b.data(), data + 8 + header + t.begin, b.size()) != 0) {
        std::abort();
      }
      covered = t.end;
      if (elements(f, t) != numel) std::abort();
    }
    if (8 + header + covered != size) std::abort();
  } catch (const shardlib::io_error&) {
    // Rejected with the library's error: the outcome the fuzzer accepts for bad input.
  }
  return 0;
}
