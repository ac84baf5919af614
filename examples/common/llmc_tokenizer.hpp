// examples/common/llmc_tokenizer.hpp — llm.c's tokenizer file (train_gpt2.py's
// write_tokenizer: gpt2_tokenizer.bin), enough to print the language-model examples'
// samples as text: 256 little-endian int32 of header (magic 20240328, version 1, or 2 with
// the end-of-text token in header[3]; the number of tokens in header[2]), then each
// token's bytes, a one-byte length before them.
#pragma once
#include <shardlib/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace example {

struct llmc_tokenizer {
  std::vector<std::string> pieces;  // each token's bytes
  std::int64_t end_of_text = -1;    // version 2's; -1 for version 1

  explicit llmc_tokenizer(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read --tokenizer ", path);
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    constexpr std::size_t header = 256 * 4;
    shardlib::require(bytes.size() >= header, path, ": ", bytes.size(),
                      " bytes, less than the 1024-byte header of llm.c's tokenizer files");
    std::int32_t h[4];
    std::memcpy(h, bytes.data(), sizeof h);
    shardlib::require(h[0] == 20240328 && (h[1] == 1 || h[1] == 2) && h[2] > 0, path, ": magic ", h[0], " version ",
                      h[1], " with ", h[2], " tokens is not llm.c's tokenizer file (magic 20240328, version 1 or 2)");
    if (h[1] == 2) end_of_text = h[3];
    std::size_t at = header;
    for (std::int32_t i = 0; i < h[2]; ++i) {
      shardlib::require(at < bytes.size(), path, ": ends after ", i, " of its ", h[2], " tokens");
      const auto length = std::size_t(static_cast<unsigned char>(bytes[at]));
      shardlib::require(at + 1 + length <= bytes.size(), path, ": token ", i, "'s ", length,
                        " bytes run past the end of the file");
      pieces.push_back(bytes.substr(at + 1, length));
      at += 1 + length;
    }
    shardlib::require(at == bytes.size(), path, ": ", bytes.size() - at, " bytes follow its ", h[2], " tokens");
  }

  // The text of `ids`; an id the file does not hold as <id>.
  template <class Ids>
  std::string decode(const Ids& ids) const {
    std::string text;
    for (const auto id : ids)
      text += id >= 0 && std::size_t(id) < pieces.size() ? pieces[std::size_t(id)]
                                                          : "<" + std::to_string(id) + ">";
    return text;
  }
};

}  // namespace example
