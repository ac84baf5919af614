// libFuzzer target: a checkpoint with one file replaced by the input must verify, load
// and consolidate without crashing, raising shardlib::io_error at worst.
//
// The first input byte picks the file: 0 is metadata.json, whose body (the rest of the
// input) is wrapped with its correct checksum so that the fuzzer reaches the field
// validation behind it; 1 and 2 are the two shard files, taken as they are.
// Seeds: tests/fuzz/corpus_checkpoint (a valid body and both valid shard files).
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/checkpoint.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/optim/adam.hpp"
#include "shardlib/shard/sharded_model.hpp"

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
using Block = nn::Linear<float>;
using Model = nn::Sequential<nn::Linear<float>, nn::Stack<Block>, nn::Linear<float>>;

Model make_model() { return Model{nn::Linear<float>(5, 12), nn::Stack<Block>(2, Block(12, 12)), nn::Linear<float>(12, 3)}; }
shard::options wrap_blocks() { return {.wrap = shard::wrap_types<Block>{}, .seed = 42}; }

const fs::path& root() {
  static const fs::path dir = fs::temp_directory_path() / ("shardlib_fuzz_checkpoint_" + std::to_string(::getpid()));
  return dir;
}

// A valid two-rank checkpoint, saved once per process.
const fs::path& pristine() {
  static const fs::path ckpt = [] {
    fs::remove_all(root());
    comm::launch(2, [](comm::ThreadComm& c) {
      Model m = make_model();
      auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks());
      optim::Adam adam;
      io::save_checkpoint(root() / "pristine", model, adam, {.tag = "ckpt", .chunk_bytes = 128});
    });
    std::atexit([] { fs::remove_all(root()); });
    return root() / "pristine" / "ckpt";
  }();
  return ckpt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fs::path& source = pristine();  // first: making it clears root()
  const fs::path work = root() / "work" / "ckpt";
  fs::remove_all(root() / "work");
  fs::create_directories(work.parent_path());
  fs::copy(source, work);
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  {
    const int which = data[0] % 3;
    std::ofstream out(work / (which == 0 ? "metadata.json"
                              : which == 1 ? "shard-00000-of-00002.safetensors"
                                           : "shard-00001-of-00002.safetensors"),
                      std::ios::binary | std::ios::trunc);
    if (which == 0)
      out << "{\"xxh3_64\":\"" << io::detail::hex(io::detail::xxh3(payload)) << "\",\"metadata\":" << payload << "}\n";
    else
      out << payload;
  }
  io::verify_checkpoint(work);  // reports problems, never throws
  try {
    io::checkpoint_to_safetensors(work, root() / "work" / "out.safetensors", true);
  } catch (const io_error&) {
  }
  try {
    comm::launch(1, [&](comm::ThreadComm& c) {  // a resharding load, 2 -> 1 rank
      Model m = make_model();
      auto model = shard::fully_shard(m, c, shard::FullShard{}, wrap_blocks());
      optim::Adam adam;
      try {
        io::load_checkpoint(work, model, adam);
      } catch (const io_error&) {
        // rejected with the library's error: what bad input should get
      }
    });
  } catch (...) {
    std::abort();  // anything else escaped the load
  }
  return 0;
}
