// libFuzzer target: Hugging Face's sharded layout (model.safetensors.index.json beside
// model-0000k-of-0000n.safetensors) with one file replaced by the input must load into a
// model or raise shardlib::io_error, never crash.
//
// The first input byte picks the file: 0 is the index, 1.. the shard files; the rest of
// the input is the file. Seeds: tests/fuzz/corpus_state_dict (the valid files, so
// prefixed).
#include "shardlib/io/state_dict.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>  // std::abort, std::atexit
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>  // getpid

namespace {

using namespace shardlib;
namespace fs = std::filesystem;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<nn::Linear<float>>, nn::Linear<float>>;

Model make_model() {
  return Model{nn::Linear<float>(5, 8), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(8, 8)),
               nn::Linear<float>(8, 3)};
}
// Transposed [in, out] weights in the file, as GPT-2's Conv1D.
io::state_dict_options options() { return {.transposed = {".weight"}}; }

const fs::path& root() {
  static const fs::path dir = fs::temp_directory_path() / ("shardlib_fuzz_state_dict_" + std::to_string(::getpid()));
  return dir;
}

// A valid sharded save (four files), written once per process.
const fs::path& pristine() {
  static const fs::path saved = [] {
    fs::remove_all(root());
    Model m = make_model();
    nn::Replicated<float, Model> owner(m, 42);
    auto o = options();
    o.max_shard_bytes = 300;
    io::save_state_dict(root() / "pristine", owner, o);
    std::atexit([] { fs::remove_all(root()); });
    return root() / "pristine";
  }();
  return saved;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fs::path& source = pristine();  // first: making it clears root()
  const fs::path work = root() / "work";
  fs::remove_all(work);
  fs::copy(source, work);
  const int which = data[0] % 5;
  const std::string name = which == 0 ? "model.safetensors.index.json" : io::detail::shard_file_name(which, 4);
  std::ofstream(work / name, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data) + 1, std::streamsize(size - 1));
  try {
    Model m = make_model();
    nn::Replicated<float, Model> owner(m, 7);
    try {
      io::load_state_dict(work, owner, options());
    } catch (const io_error&) {
      // rejected with the library's error: what bad input should get
    }
  } catch (...) {
    std::abort();  // anything else escaped the load
  }
  return 0;
}
