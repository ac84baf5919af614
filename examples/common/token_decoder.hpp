// examples/common/token_decoder.hpp — token ids back to text, to print the language-model
// examples' samples (--tokenizer): each id's bytes from llm.c's tokenizer file or from a
// Hugging Face tokenizer.json. Decoding only; the examples read ids that others tokenized.
//   llm.c's file (train_gpt2.py's write_tokenizer, gpt2_tokenizer.bin): 256 little-endian
//     int32 of header (magic 20240328, version 1, or 2 with the end-of-text token in
//     header[3]; the number of tokens in header[2]), then each token's bytes after a
//     one-byte length.
//   tokenizer.json: the BPE model's vocabulary and the added tokens, decoded as its decoder
//     says: ByteLevel (GPT-2, Llama 3: each character stands for one byte, GPT-2's
//     bytes_to_unicode table), or SentencePiece's sequence (LLaMA 2: Replace "▁" by " ",
//     ByteFallback <0xNN> to its byte, Fuse, Strip one leading space). Byte runs that are
//     not UTF-8 stay as bytes, where tokenizers writes U+FFFD.
#pragma once
#include <shardlib/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace example {

struct token_decoder {
  std::vector<std::string> pieces;  // each id's bytes
  bool strip_leading_space = false;  // SentencePiece's Strip(" ", 1, 0)

  // By its content: a JSON object is tokenizer.json, anything else llm.c's file.
  static token_decoder read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    shardlib::require(bool(in), "cannot read --tokenizer ", path);
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const auto first = bytes.find_first_not_of(" \t\r\n");
    return first != std::string::npos && bytes[first] == '{' ? from_json_file(path, bytes) : from_llmc(path, bytes);
  }

  // The text of `ids`; an id the tokenizer does not hold as <id>. `from_start`: the ids begin
  // the text (SentencePiece strips its first space there, not before later pieces).
  template <class Ids>
  std::string decode(const Ids& ids, bool from_start = true) const {
    std::string text;
    for (const auto id : ids)
      text += id >= 0 && std::size_t(id) < pieces.size() ? pieces[std::size_t(id)] : "<" + std::to_string(id) + ">";
    if (from_start && strip_leading_space && !text.empty() && text[0] == ' ') text.erase(0, 1);
    return text;
  }

 private:
  static token_decoder from_llmc(const std::string& path, const std::string& bytes) {
    constexpr std::size_t header = 256 * 4;
    shardlib::require(bytes.size() >= header, path, ": ", bytes.size(),
                      " bytes, neither a tokenizer.json nor as long as the 1024-byte header of llm.c's tokenizer files");
    std::int32_t h[4];
    std::memcpy(h, bytes.data(), sizeof h);
    shardlib::require(h[0] == 20240328 && (h[1] == 1 || h[1] == 2) && h[2] > 0, path, ": magic ", h[0], " version ",
                      h[1], " with ", h[2], " tokens is not llm.c's tokenizer file (magic 20240328, version 1 or 2)");
    token_decoder d;
    std::size_t at = header;
    for (std::int32_t i = 0; i < h[2]; ++i) {
      shardlib::require(at < bytes.size(), path, ": ends after ", i, " of its ", h[2], " tokens");
      const auto length = std::size_t(static_cast<unsigned char>(bytes[at]));
      shardlib::require(at + 1 + length <= bytes.size(), path, ": token ", i, "'s ", length,
                        " bytes run past the end of the file");
      d.pieces.push_back(bytes.substr(at + 1, length));
      at += 1 + length;
    }
    shardlib::require(at == bytes.size(), path, ": ", bytes.size() - at, " bytes follow its ", h[2], " tokens");
    return d;
  }

  // Each code point of UTF-8 `s` with its bytes (tokenizer.json's strings are valid UTF-8).
  static std::vector<std::pair<std::uint32_t, std::string>> code_points(const std::string& s) {
    std::vector<std::pair<std::uint32_t, std::string>> out;
    for (std::size_t i = 0; i < s.size();) {
      const auto c = static_cast<unsigned char>(s[i]);
      const std::size_t n = std::min<std::size_t>(c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4, s.size() - i);
      std::uint32_t cp = n == 1 ? c : c & (0xFFu >> (n + 1));
      for (std::size_t k = 1; k < n; ++k) cp = cp << 6 | (static_cast<unsigned char>(s[i + k]) & 0x3Fu);
      out.emplace_back(cp, s.substr(i, n));
      i += n;
    }
    return out;
  }
  // GPT-2's bytes_to_unicode, inverted: the byte each of its 256 characters stands for.
  static std::vector<int> byte_of_character() {
    std::vector<int> byte(512, -1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte[std::size_t(printable ? b : 256 + extra++)] = b;
    }
    return byte;
  }

  static token_decoder from_json_file(const std::string& path, const std::string& bytes) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(bytes);
    } catch (const nlohmann::json::exception& e) {
      throw shardlib::error(shardlib::cat(path, ": ", e.what()));
    }
    const auto& model = j.contains("model") ? j["model"] : nlohmann::json();
    shardlib::require(model.is_object() && model.value("type", "") == "BPE" && model.contains("vocab") &&
                          model["vocab"].is_object(),
                      path, ": not a BPE tokenizer.json (its model's type ", model.is_object() ? model.value("type", "?") : "?",
                      "; GPT-2's, Llama's and their kin's are BPE)");
    // The decoder: ByteLevel, or SentencePiece's Sequence of Replace, ByteFallback, Fuse, Strip.
    const auto& dec = j.contains("decoder") ? j["decoder"] : nlohmann::json();
    const std::string type = dec.is_object() ? dec.value("type", "") : "";
    bool byte_level = type == "ByteLevel", sentencepiece = false, byte_fallback = false, fused = false;
    token_decoder d;
    if (type == "Sequence" && dec.contains("decoders")) {
      for (const auto& step : dec["decoders"]) {
        const std::string t = step.value("type", "");
        if (t == "Replace" || t == "Fuse") sentencepiece = true, fused = fused || t == "Fuse";
        else if (t == "ByteFallback") sentencepiece = byte_fallback = true;
        else if (t == "Strip" && fused && step.value("content", "") == " " && step.value("start", 0) == 1 &&
                 step.value("stop", 0) == 0)
          d.strip_leading_space = true;  // once, on the fused text
        else if (t == "ByteLevel") byte_level = true;
        else throw shardlib::error(shardlib::cat(path, ": decoder step ", step.dump(), " is not one the examples decode"));
      }
    }
    shardlib::require(byte_level != sentencepiece, path, ": decoder ", dec.dump(),
                      " is neither ByteLevel (GPT-2, Llama 3) nor SentencePiece's Replace/ByteFallback/Fuse/Strip (LLaMA 2)");
    // Each id's token, the added tokens' over the vocabulary's; all go through the decoder
    // (as tokenizers' decode with skip_special_tokens=False does).
    std::vector<std::string> tokens;
    const auto put = [&](std::size_t id, std::string t) {
      if (tokens.size() <= id) tokens.resize(id + 1);
      tokens[id] = std::move(t);
    };
    for (const auto& [piece, id] : model["vocab"].items()) put(id.get<std::size_t>(), piece);
    if (j.contains("added_tokens"))
      for (const auto& t : j["added_tokens"]) put(t["id"].get<std::size_t>(), t["content"].get<std::string>());
    const std::vector<int> byte = byte_of_character();
    for (const std::string& piece : tokens) {
      std::string out;
      const auto hex = [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)) != 0; };
      if (byte_level) {  // a token with a character outside the table stays as it is, as tokenizers keeps it
        bool all = true;
        for (const auto& [cp, utf8] : code_points(piece)) {
          all = all && cp < byte.size() && byte[cp] >= 0;
          if (all) out += char(byte[cp]);
        }
        if (!all) out = piece;
      } else if (byte_fallback && piece.size() == 6 && piece.starts_with("<0x") && hex(piece[3]) && hex(piece[4]) &&
                 piece.back() == '>') {
        out += char(std::stoi(piece.substr(3, 2), nullptr, 16));
      } else {
        for (std::size_t at = 0; at < piece.size();) {  // Replace "▁" (U+2581) by " "
          if (piece.compare(at, 3, "\xE2\x96\x81") == 0) {
            out += ' ';
            at += 3;
          } else {
            out += piece[at++];
          }
        }
      }
      d.pieces.push_back(std::move(out));
    }
    return d;
  }
};

}  // namespace example
