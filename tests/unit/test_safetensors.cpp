// safetensors: round trips, the on-disk layout, every validation rule, and random mutants;
// state dicts under other names and layouts (io/state_dict.hpp, io/hf_checkpoint.hpp),
// sharded and plain, and the files transformers wrote (tests/golden/hf).
#include "shardlib/comm/launch.hpp"
#include "shardlib/io/hf_checkpoint.hpp"
#include "shardlib/io/safetensors.hpp"
#include "shardlib/io/state_dict.hpp"
#include "shardlib/nn/embedding.hpp"
#include "shardlib/nn/linear.hpp"
#include "shardlib/nn/replicated.hpp"
#include "shardlib/nn/sequential.hpp"
#include "shardlib/nn/stack.hpp"
#include "shardlib/nn/tied_linear.hpp"
#include "shardlib/shard/sharded_model.hpp"

#include <catch2/catch.hpp>

#include <algorithm>  // std::equal
#include <array>
#include <cctype>    // std::isdigit
#include <charconv>  // std::from_chars
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>  // std::istreambuf_iterator
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>  // getpid

namespace test_safetensors {

using namespace shardlib;
using namespace shardlib::io;
using namespace std::string_literals;
using Catch::Contains;
using Catch::EndsWith;
using Catch::StartsWith;
namespace fs = std::filesystem;

namespace {

// A fresh directory, removed with its contents at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    static int count = 0;
    path = fs::temp_directory_path() /
           ("shardlib_test_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(count++));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(const char* name) const { return path / name; }
};

std::vector<std::byte> to_bytes(std::string_view s) {
  std::vector<std::byte> b(s.size());
  std::transform(s.begin(), s.end(), b.begin(), [](char c) { return std::byte(c); });
  return b;
}

std::vector<std::byte> read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return to_bytes(std::string(std::istreambuf_iterator<char>(in), {}));
}

// The temporaries a writer of target has left beside it ("<target>.tmp.<pid>.<n>").
std::vector<std::string> temporaries(const fs::path& target) {
  std::vector<std::string> found;
  const std::string prefix = target.filename().string() + ".tmp.";
  for (const auto& e : fs::directory_iterator(target.parent_path()))
    if (e.path().filename().string().starts_with(prefix)) found.push_back(e.path().filename().string());
  return found;
}

void write_all(const fs::path& p, const std::vector<std::byte>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

// The size field written byte by byte, independently of the library.
std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char((v >> (8 * i)) & 0xFF);
  return s;
}

std::uint64_t get_le64(const std::vector<std::byte>& b) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::uint64_t(std::to_integer<unsigned>(b[i])) << (8 * i);
  return v;
}

void set_le64(std::vector<std::byte>& b, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[i] = std::byte((v >> (8 * i)) & 0xFF);
}

std::vector<std::byte> make_file(std::string_view header, std::string_view data = {}) {
  return to_bytes(le64(header.size()) + std::string(header) + std::string(data));
}

std::vector<std::byte> make_file(std::string_view header, std::size_t data_bytes) {
  return make_file(header, std::string(data_bytes, '\0'));
}

// The message of the io_error that parsing throws; any other exception fails the test.
std::string parse_error(std::vector<std::byte> file) {
  try {
    safetensors::parse(std::move(file), "bad.safetensors");
  } catch (const io_error& e) {
    return e.what();
  }
  FAIL("the file was accepted");
  return {};
}

#define CHECK_REJECTS(file, what) CHECK_THAT(parse_error(file), StartsWith("bad.safetensors: ") && Contains(what))

template <class T>
std::array<T, 6> sample() {
  if constexpr (std::is_same_v<T, bool>) {
    return {true, false, false, true, true, false};
  } else {
    return {T(0), T(1), T(-2), T(3), T(100), T(-7)};
  }
}

// Calls f with a value of the element type of t.
template <class F>
void visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f64: return f(double{});
    case dtype::f32: return f(float{});
    case dtype::f16: return f(half{});
    case dtype::bf16: return f(bfloat16{});
    case dtype::i64: return f(std::int64_t{});
    case dtype::i32: return f(std::int32_t{});
    case dtype::i16: return f(std::int16_t{});
    case dtype::i8: return f(std::int8_t{});
    case dtype::u8: return f(std::uint8_t{});
    case dtype::boolean: return f(bool{});
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Round trips and layout

TEMPLATE_TEST_CASE("every dtype round-trips through a file", "[io][safetensors]", double, float, half, bfloat16,
                   std::int64_t, std::int32_t, std::int16_t, std::int8_t, std::uint8_t, bool) {
  temp_dir dir;
  const auto values = sample<TestType>();
  safetensors_writer w;
  w.add<TestType>("t", Shape{2, 3}, std::span<const TestType>(values));
  w.write(dir / "a.safetensors");

  const auto raw = read_all(dir / "a.safetensors");
  const std::string text(reinterpret_cast<const char*>(raw.data()), raw.size());
  CHECK_THAT(text, Contains(R"("dtype":")" + std::string(name(dtype_of<TestType>)) + "\""));

  const auto f = safetensors::load(dir / "a.safetensors");
  const tensor_info& t = f.info("t");
  CHECK(t.type == dtype_of<TestType>);
  CHECK(t.shape == Shape{2, 3});
  CHECK(t.end - t.begin == 6 * sizeof(TestType));
  const auto expected = std::as_bytes(std::span(values));
  CHECK(std::equal(expected.begin(), expected.end(), f.bytes("t").begin(), f.bytes("t").end()));
  const std::vector<TestType> got = f.get<TestType>("t");
  CHECK(std::equal(values.begin(), values.end(), got.begin(), got.end()));
}

TEST_CASE("empty tensors and 0-d scalars round-trip", "[io][safetensors]") {
  temp_dir dir;
  const float scalar = 2.5f;
  const std::int32_t after[] = {7, 8};
  safetensors_writer w;
  w.add<float>("empty", Shape{0}, {});
  w.add<float>("scalar", Shape{}, std::span(&scalar, 1));
  w.add<std::int32_t>("hollow", Shape{3, 0, 2}, {});
  w.add<std::int32_t>("after", Shape{2}, std::span(after));
  w.write(dir / "e.safetensors");

  const auto f = safetensors::load(dir / "e.safetensors");
  CHECK(f.info("empty").shape == Shape{0});
  CHECK(f.info("empty").shape.rank() == 1);
  CHECK(f.bytes("empty").empty());
  CHECK(f.get<float>("empty").empty());
  CHECK(f.info("scalar").shape.rank() == 0);
  CHECK(f.get<float>("scalar") == std::vector<float>{2.5f});
  CHECK(f.info("hollow").shape == Shape{3, 0, 2});
  CHECK(f.get<std::int32_t>("hollow").empty());
  CHECK(f.get<std::int32_t>("after") == std::vector<std::int32_t>{7, 8});
  const auto raw = read_all(dir / "e.safetensors");
  CHECK_THAT(std::string(reinterpret_cast<const char*>(raw.data()), raw.size()), Contains(R"("shape":[])"));
}

TEST_CASE("metadata round-trips, and without metadata the header has none", "[io][safetensors]") {
  temp_dir dir;
  const float x[] = {1};
  safetensors_writer w;
  w.add<float>("x", Shape{1}, std::span(x));
  w.write(dir / "plain.safetensors");
  w.set_metadata("format", "pt");
  w.set_metadata("step", "1");
  w.set_metadata("step", "12");  // set, not append
  w.write(dir / "meta.safetensors");

  const auto plain = read_all(dir / "plain.safetensors");
  CHECK_THAT(std::string(reinterpret_cast<const char*>(plain.data()), plain.size()), !Contains("__metadata__"));
  CHECK(safetensors::load(dir / "plain.safetensors").metadata().empty());
  const std::map<std::string, std::string> expected{{"format", "pt"}, {"step", "12"}};
  CHECK(safetensors::load(dir / "meta.safetensors").metadata() == expected);
  CHECK(read_safetensors_header(dir / "meta.safetensors").metadata == expected);
}

TEST_CASE("a hand-built file parses to the expected tensors", "[io][safetensors]") {
  // Unpadded and listed out of data order; 1.5f = 0x3FC00000, -2.0f = 0xC0000000, little-endian.
  const auto file =
      make_file(R"({"b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"},)"
                R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                "\x00\x00\xc0\x3f\x00\x00\x00\xc0\x07\x00\xff\xff"s);
  const auto f = safetensors::parse(file, "known");
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.tensors()[0] == tensor_info{"a", dtype::f32, Shape{2}, 0, 8});
  CHECK(f.tensors()[1] == tensor_info{"b", dtype::i16, Shape{1, 2}, 8, 12});
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(f.get<float>("a") == std::vector<float>{1.5f, -2.0f});
  CHECK(f.get<std::int16_t>("b") == std::vector<std::int16_t>{7, -1});
  CHECK(f.bytes("b").size() == 4);
  CHECK(f.bytes("b")[3] == std::byte{0xff});
  CHECK(f.contains("a"));
  CHECK_FALSE(f.contains("c"));
}

TEST_CASE("the writer lays the file out as the format says, byte for byte", "[io][safetensors]") {
  temp_dir dir;
  const float a[] = {1.5f, -2.0f};
  const std::int16_t b[] = {7, -1};
  safetensors_writer w;
  w.add<float>("a", Shape{2}, std::span(a));
  w.add<std::int16_t>("b", Shape{1, 2}, std::span(b));
  w.set_metadata("format", "pt");
  w.write(dir / "w.safetensors");

  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]}})";
  while ((8 + header.size()) % 8 != 0) header += ' ';
  CHECK(read_all(dir / "w.safetensors") == make_file(header, "\x00\x00\xc0\x3f\x00\x00\x00\xc0\x07\x00\xff\xff"s));
}

TEST_CASE("the writer pads the header with spaces so the data starts at a multiple of 8", "[io][safetensors]") {
  temp_dir dir;
  const std::uint8_t x[] = {1};
  for (std::size_t len = 1; len <= 8; ++len) {
    safetensors_writer w;
    w.add<std::uint8_t>(std::string(len, 'n'), Shape{1}, std::span(x));
    w.write(dir / "p.safetensors");
    const auto h = read_safetensors_header(dir / "p.safetensors");
    CHECK(h.data_start() % 8 == 0);
    const auto raw = read_all(dir / "p.safetensors");
    std::size_t json_end = h.data_start();
    while (raw[json_end - 1] == std::byte{' '}) --json_end;
    CHECK(raw[json_end - 1] == std::byte{'}'});
    CHECK(h.data_start() - json_end < 8);
    CHECK(raw[h.data_start()] == std::byte{1});
  }
}

TEST_CASE("the stream writer writes the same bytes as the collecting writer", "[io][safetensors]") {
  temp_dir dir;
  const double w0[] = {1, 2, 3, 4, 5, 6};
  const half w1[] = {half(0.5f), half(-1.0f), half(3.0f)};
  const bool w2[] = {true, false};
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"note", "\xc3\xa9t\xc3\xa9"}};

  safetensors_writer collect;
  collect.add<double>("layers.0.weight", Shape{2, 3}, std::span(w0));
  collect.add<half>("layers.0.bias", Shape{3}, std::span(w1));
  collect.add<bool>("mask", Shape{2, 1}, std::span(w2));
  for (const auto& [k, v] : metadata) collect.set_metadata(k, v);
  collect.write(dir / "c.safetensors");

  // begin/end of the declarations are ignored: offsets come from the declared order.
  std::vector<tensor_info> declared{{"layers.0.weight", dtype::f64, Shape{2, 3}, 99, 7},
                                    {"layers.0.bias", dtype::f16, Shape{3}, 0, 0},
                                    {"mask", dtype::boolean, Shape{2, 1}, 5, 5}};
  {
    safetensors_stream_writer s(dir / "s.safetensors", declared, metadata);
    s.write("layers.0.weight", std::as_bytes(std::span(w0)));
    s.write("layers.0.bias", std::as_bytes(std::span(w1)));
    s.write("mask", std::as_bytes(std::span(w2)));
    s.finish();
  }
  CHECK(read_all(dir / "s.safetensors") == read_all(dir / "c.safetensors"));
  CHECK(temporaries(dir / "s.safetensors").empty());
  CHECK(temporaries(dir / "c.safetensors").empty());

  const auto f = safetensors::load(dir / "s.safetensors");
  const auto h = read_safetensors_header(dir / "s.safetensors");
  CHECK(h.tensors == f.tensors());
  CHECK(h.metadata == metadata);
  CHECK(h.data_start() + h.tensors.back().end == fs::file_size(dir / "s.safetensors"));
  CHECK(f.get<bool>("mask") == std::vector<bool>{true, false});
}

TEST_CASE("the stream writer enforces the declared order and sizes", "[io][safetensors]") {
  temp_dir dir;
  const float a[] = {1, 2};
  const std::vector<tensor_info> declared{{"a", dtype::f32, Shape{2}, 0, 0}, {"b", dtype::f32, Shape{1}, 0, 0}};
  const std::string origin = (dir / "o.safetensors").string();
  safetensors_stream_writer s(dir / "o.safetensors", declared, {});
  CHECK_THROWS_WITH(s.write("b", std::as_bytes(std::span(a).first(1))),
                    StartsWith(origin) && Contains("write(\"b\"): the next declared tensor is \"a\""));
  CHECK_THROWS_WITH(s.write("a", std::as_bytes(std::span(a).first(1))),
                    Contains("tensor \"a\": expected 8 bytes, got 4"));
  s.write("a", std::as_bytes(std::span(a)));
  CHECK_THROWS_WITH(s.finish(), Contains("finish(): tensor \"b\" (2 of 2) was not written"));
  s.write("b", std::as_bytes(std::span(a).first(1)));
  CHECK_THROWS_WITH(s.write("c", {}), Contains("all 2 declared tensors are already written"));
  s.finish();
  CHECK_THROWS_WITH(s.finish(), Contains("no longer open"));
  CHECK(safetensors::load(dir / "o.safetensors").get<float>("b") == std::vector<float>{1});
}

TEST_CASE("an unfinished stream writer leaves neither the file nor its temporary", "[io][safetensors]") {
  temp_dir dir;
  const float a[] = {1, 2};
  {
    safetensors_stream_writer s(dir / "u.safetensors", {{"a", dtype::f32, Shape{2}, 0, 0}}, {});
    s.write("a", std::as_bytes(std::span(a)));
    CHECK(temporaries(dir / "u.safetensors").size() == 1);
    CHECK_FALSE(fs::exists(dir / "u.safetensors"));
  }
  CHECK(temporaries(dir / "u.safetensors").empty());
  CHECK_FALSE(fs::exists(dir / "u.safetensors"));
}

TEST_CASE("two writers of one file each write their own temporary, and the last to finish wins whole",
          "[io][safetensors]") {
  // Every rank saving the same path: with one shared temporary, a writer that started
  // later truncated the bytes an earlier one had written, and the earlier one's rename
  // then put a file of the right size with zeros in it in place.
  temp_dir dir;
  const auto path = dir / "shared.safetensors";
  const std::vector<float> ones(1024, 1.0f), twos(1024, 2.0f);
  const std::vector<tensor_info> declared{{"x", dtype::f32, Shape{1024}, 0, 0}};
  safetensors_stream_writer a(path, declared, {}), b(path, declared, {});
  CHECK(temporaries(path).size() == 2);
  a.write("x", std::as_bytes(std::span(ones)));
  b.write("x", std::as_bytes(std::span(twos)));
  a.finish();
  CHECK(safetensors::load(path).get<float>("x") == ones);
  b.finish();
  CHECK(safetensors::load(path).get<float>("x") == twos);
  CHECK(temporaries(path).empty());
}

TEST_CASE("a moved stream writer keeps writing the same file", "[io][safetensors]") {
  temp_dir dir;
  const std::int8_t a[] = {1, 2, 3};
  std::optional<safetensors_stream_writer> first;
  first.emplace(dir / "m.safetensors", std::vector<tensor_info>{{"a", dtype::i8, Shape{3}, 0, 0}},
                std::map<std::string, std::string>{});
  safetensors_stream_writer second = std::move(*first);
  first.reset();  // the moved-from writer must not remove the temporary
  second.write("a", std::as_bytes(std::span(a)));
  second.finish();
  CHECK(safetensors::load(dir / "m.safetensors").get<std::int8_t>("a") == std::vector<std::int8_t>{1, 2, 3});
}

TEST_CASE("the stream writer rejects bad declarations before creating any file", "[io][safetensors]") {
  temp_dir dir;
  const auto path = dir / "d.safetensors";
  using decl = std::vector<tensor_info>;
  CHECK_THROWS_WITH(
      (safetensors_stream_writer(path, decl{{"a", dtype::f32, Shape{1}, 0, 0}, {"a", dtype::i8, Shape{1}, 0, 0}}, {})),
      StartsWith(path.string()) && Contains("duplicate tensor name \"a\""));
  CHECK_THROWS_WITH((safetensors_stream_writer(path, decl{{"__metadata__", dtype::f32, Shape{1}, 0, 0}}, {})),
                    Contains("\"__metadata__\" is reserved"));
  CHECK_THROWS_WITH((safetensors_stream_writer(path, decl{{"\xff", dtype::f32, Shape{1}, 0, 0}}, {})),
                    Contains("not valid UTF-8"));
  CHECK(fs::is_empty(dir.path));
}

TEST_CASE("the writer checks sizes and names", "[io][safetensors]") {
  const float a[] = {1, 2};
  safetensors_writer w;
  CHECK_THROWS_WITH(
      w.add<float>("a", Shape{3}, std::span(a)),
      StartsWith("safetensors_writer: ") && Contains("tensor \"a\": shape [3] of F32 needs 12 bytes, got 8"));
  CHECK_THROWS_WITH(w.add("a", dtype::f64, Shape{1}, std::as_bytes(std::span(a)).first(4)),
                    Contains("needs 8 bytes, got 4"));
  w.add<float>("a", Shape{2}, std::span(a));
  CHECK_THROWS_WITH(w.add<float>("a", Shape{2}, std::span(a)), Contains("duplicate tensor name \"a\""));
  CHECK_THROWS_WITH(w.add<float>("__metadata__", Shape{2}, std::span(a)), Contains("\"__metadata__\" is reserved"));
  CHECK_THROWS_AS((Shape{std::int64_t{1} << 62, 4}), shape_error);  // too big to describe: no writer sees it
}

TEST_CASE("a failed write leaves an existing file untouched and no temporary", "[io][safetensors]") {
  temp_dir dir;
  const auto path = dir / "keep.safetensors";
  const float a[] = {1, 2};
  safetensors_writer good;
  good.add<float>("a", Shape{2}, std::span(a));
  good.write(path);
  const auto before = read_all(path);

  safetensors_writer bad = good;
  bad.set_metadata("k", "\xff");
  CHECK_THROWS_WITH(bad.write(path), StartsWith(path.string()) && Contains("not valid UTF-8"));
  CHECK(read_all(path) == before);
  CHECK(temporaries(dir / "keep.safetensors").empty());

  CHECK_THROWS_WITH(good.write(dir / "missing" / "x.safetensors"),
                    Contains((dir / "missing" / "x.safetensors").string()) && Contains("cannot create"));

  // Rewriting replaces the whole file, also with a shorter one.
  safetensors_writer small;
  small.write(path);
  CHECK(read_all(path) == make_file("{}      "));
}

TEST_CASE("the writer refuses a header larger than readers accept", "[io][safetensors]") {
  temp_dir dir;
  safetensors_writer w;
  w.set_metadata("big", std::string(100'000'000, 'x'));
  CHECK_THROWS_WITH(w.write(dir / "big.safetensors"), Contains("more than the 100000000 that readers accept"));
  CHECK(fs::is_empty(dir.path));
}

// ---------------------------------------------------------------------------------------
// Validation: one test per rule, each checking the message

TEST_CASE("rejects a file shorter than the size field", "[io][safetensors]") {
  CHECK_REJECTS(to_bytes("\x02\x00\x00\x00\x00"s), "holds 5 bytes, fewer than the 8-byte header size");
  CHECK_REJECTS(std::vector<std::byte>{}, "holds 0 bytes");
}

TEST_CASE("rejects a header size beyond the file", "[io][safetensors]") {
  CHECK_REJECTS(to_bytes(le64(100) + "{}        "), "header size 100 runs past the end of the file: only 10 bytes");
  CHECK_REJECTS(to_bytes(le64(3) + "{}"), "header size 3 runs past the end of the file: only 2 bytes");
}

TEST_CASE("rejects a header size over the 100 MB limit", "[io][safetensors]") {
  CHECK_REJECTS(to_bytes(le64(100'000'001) + "{}"), "header size 100000001 exceeds the limit of 100000000 bytes");
  CHECK_REJECTS(to_bytes(le64(~std::uint64_t{0}) + "{}"), "exceeds the limit");
  CHECK_REJECTS(to_bytes(le64(100'000'000) + "{}"), "runs past the end of the file");  // the limit itself is allowed
}

TEST_CASE("rejects a header that is not valid JSON", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"a":)"), "the header is not valid JSON");
  CHECK_REJECTS(make_file("{} x"), "the header is not valid JSON");
  CHECK_REJECTS(make_file("{}\0{\"hidden\":1}"s), "the header is not valid JSON: it holds a NUL byte at offset 2");
  CHECK_REJECTS(make_file(R"({"a":1e400})"), "the header is not valid JSON");
  CHECK_REJECTS(make_file("{\"\xff\":1}"), "the header is not valid JSON");  // not UTF-8
  CHECK_REJECTS(make_file("{/* comment */}"), "the header is not valid JSON");
  // Nesting is bounded while parsing (copying a value recurses): 511 levels under the
  // header's object are read, and refused only for what they hold; 512 are not JSON here.
  const auto nested = [](int levels) { return R"({"a":)" + std::string(levels, '[') + std::string(levels, ']') + "}"; };
  CHECK_THAT(parse_error(make_file(nested(511))), !Contains("deeper than"));
  CHECK_REJECTS(make_file(nested(512)), "the header is not valid JSON here: it nests objects and arrays deeper than 512");
  CHECK_REJECTS(make_file(nested(1'000'000)), "deeper than 512 levels");
}

TEST_CASE("rejects a header that is not a JSON object", "[io][safetensors]") {
  CHECK_REJECTS(make_file("[]"), "the header must be a JSON object, starting with '{'; found byte 0x5b");
  CHECK_REJECTS(make_file(" {}"), "found byte 0x20");
  CHECK_REJECTS(make_file(""), "found an empty header");
}

TEST_CASE("rejects tensor entries missing a field", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4), R"(tensor "w": the entry has no "dtype")");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4),
                R"(tensor "w": the entry has no "shape")");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1]}})", 4), R"(tensor "w": the entry has no "data_offsets")");
}

TEST_CASE("rejects tensor entries with wrong JSON types", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":5})"),
                R"(tensor "w": the entry must be an object with dtype, shape and data_offsets, found number)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", 4),
                R"("dtype" must be a string, found number)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4),
                R"("shape" must be an array of non-negative integers, found string)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", 4),
                R"("data_offsets" must be an array [begin, end] of two non-negative integers, found an array of 1)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":{"0":4}}})", 4), "found object");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":["0",4]}})", 4),
                "data_offsets begin must be a non-negative integer, found string");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", 4),
                "data_offsets end must be a non-negative integer, found 4.0");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-1,4]}})", 4),
                "data_offsets begin -1 is negative");
}

TEST_CASE("rejects unknown dtypes", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", 1),
                R"(tensor "w": unknown dtype "F8_E4M3")");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4), R"(unknown dtype "f32")");
}

TEST_CASE("rejects negative, non-integer, too large and too many shape entries", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})"),
                R"(tensor "w": shape entry 1 -1 is negative)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,0]}})"),
                "shape entry 0 must be a non-negative integer, found 2.5");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,0]}})"),
                "shape entry 0 must be a non-negative integer, found null");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]}})"),
                "shape entry 0 9223372036854775808 exceeds the maximum 9223372036854775807");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})", 4),
                "shape has rank 9, more than the maximum 8");
  // JSON's -0 is the integer 0.
  CHECK(safetensors::parse(make_file(R"({"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})"), "ok")
            .info("w")
            .shape == Shape{0});
}

TEST_CASE("rejects a byte range that does not match shape and dtype", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 12),
                R"(tensor "w": shape [2, 2] of F32 needs 16 bytes but data_offsets [0, 12] hold 12)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[0,4]}})", 4),
                "needs 0 bytes but data_offsets [0, 4] hold 4");
}

TEST_CASE("rejects shapes whose sizes overflow 64 bits", "[io][safetensors]") {
  // Shape holds at most 2^60 elements (its nonzero extents' product), so 8-byte sizes fit too.
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})"),
                "tensor \"w\": Shape [4611686018427387904, 4]: more than 2^60 elements");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})"),
                "Shape [4611686018427387904]: more than 2^60 elements");
  // Empty overall, but its nonzero extents' product overflows.
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})"),
                "Shape [4294967296, 4294967296, 0]: more than 2^60 elements");
}

TEST_CASE("rejects data_offsets that begin after they end", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8),
                R"(tensor "w": data_offsets [8, 4] begin after they end)");
}

TEST_CASE("rejects data_offsets past the end of the file", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                R"(tensor "w": data_offsets [0, 16] run past the end of the file: the data section holds 8 bytes)");
  CHECK_REJECTS(
      make_file(R"({"w":{"dtype":"I8","shape":[7],"data_offsets":[18446744073709551608,18446744073709551615]}})", 8),
      "run past the end of the file");
}

TEST_CASE("rejects overlapping byte ranges", "[io][safetensors]") {
  CHECK_REJECTS(
      make_file(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12),
      R"(tensors "a" [0, 8) and "b" [4, 12) overlap)");
  CHECK_REJECTS(
      make_file(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
          4),
      R"(tensors "a" [0, 4) and "b" [0, 4) overlap)");
  CHECK_REJECTS(
      make_file(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
          8),
      R"(tensors "a" [0, 8) and "e" [4, 4) overlap)");
}

TEST_CASE("rejects gaps between byte ranges", "[io][safetensors]") {
  CHECK_REJECTS(
      make_file(
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
          12),
      R"(bytes [4, 8) of the data section, before tensor "b", belong to no tensor)");
  CHECK_REJECTS(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                R"(bytes [0, 4) of the data section, before tensor "a")");
}

TEST_CASE("rejects data not covered by any tensor", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 6),
                "the data section holds 6 bytes but the tensors cover 4: bytes [4, 6) belong to no tensor");
  CHECK_REJECTS(make_file("{}", 3), "the data section holds 3 bytes but the tensors cover 0");
}

TEST_CASE("rejects duplicate keys at every level", "[io][safetensors]") {
  CHECK_REJECTS(
      make_file(
          R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          8),
      R"(duplicate tensor name "w" in the header)");
  CHECK_REJECTS(make_file(R"({"w":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})", 4),
                R"(duplicate key "dtype" in the header)");
  CHECK_REJECTS(make_file(R"({"__metadata__":{"k":"a","k":"b"}})"), R"(duplicate key "k" in the header)");
}

TEST_CASE("rejects __metadata__ that is not an object of strings", "[io][safetensors]") {
  CHECK_REJECTS(make_file(R"({"__metadata__":["a"]})"), R"("__metadata__" must be an object of strings, found array)");
  CHECK_REJECTS(make_file(R"({"__metadata__":{"k":1}})"),
                R"("__metadata__" value of "k" must be a string, found number)");
}

TEST_CASE("lookups name the file, the tensor and the dtypes", "[io][safetensors]") {
  const auto f = safetensors::parse(
      make_file(
          R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"m":{"dtype":"BOOL","shape":[2],"data_offsets":[4,6]}})",
          "\0\0\0\0\1\2"s),
      "x.safetensors");
  CHECK_THROWS_WITH(f.info("v"), R"(x.safetensors: no tensor "v" among its 2 tensors)");
  CHECK_THROWS_AS(f.bytes("v"), io_error);
  CHECK_THROWS_WITH(f.get<std::int32_t>("w"), R"(x.safetensors: tensor "w" has dtype F32, not the requested I32)");
  CHECK_THROWS_WITH(f.get<bool>("m"), R"(x.safetensors: tensor "m": BOOL element 1 is byte 2, not 0 or 1)");
  CHECK(f.get<float>("w") == std::vector<float>{0});
}

TEST_CASE("loading names the file in every error", "[io][safetensors]") {
  temp_dir dir;
  const auto missing = dir / "missing.safetensors";
  CHECK_THROWS_WITH(safetensors::load(missing), StartsWith(missing.string()) && Contains("cannot open for reading"));
  CHECK_THROWS_WITH(read_safetensors_header(missing), StartsWith(missing.string()) && Contains("cannot open"));
  CHECK_THROWS_WITH(safetensors::load(dir.path), Contains("not a regular file"));

  const auto bad = dir / "bad.safetensors";
  write_all(bad, make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4));
  CHECK_THROWS_WITH(safetensors::load(bad),
                    StartsWith(bad.string() + ": ") && Contains("run past the end of the file"));
  // The header alone is checked against the file's size too.
  CHECK_THROWS_WITH(read_safetensors_header(bad),
                    StartsWith(bad.string() + ": ") && Contains("run past the end of the file"));
  write_all(bad, to_bytes(le64(50) + "{}"));
  CHECK_THROWS_WITH(read_safetensors_header(bad), Contains("header size 50 runs past the end of the file"));
  write_all(bad, to_bytes("\1\0"s));
  CHECK_THROWS_WITH(read_safetensors_header(bad), Contains("holds 2 bytes, fewer than the 8-byte header size"));
}

TEST_CASE("a huge sparse file is refused with io_error before anything is allocated", "[io][safetensors]") {
  temp_dir dir;
  const std::uint64_t data = std::uint64_t(40) << 30;  // 40 GiB, of which no block is written
  const auto sparse_file = [&](const char* name, std::uint64_t claimed) {
    const std::string header = R"({"w":{"dtype":"U8","shape":[)" + std::to_string(claimed) +
                               R"(],"data_offsets":[0,)" + std::to_string(claimed) + "]}}";
    const auto file = dir / name;
    write_all(file, to_bytes(le64(header.size()) + header));
    fs::resize_file(file, 8 + header.size() + data);
    return file;
  };
  std::optional<fs::path> lying, exact;
  try {
    lying = sparse_file("lying.safetensors", std::uint64_t(1) << 40);  // a 1 TiB tensor in 40 GiB
    exact = sparse_file("exact.safetensors", data);
  } catch (const fs::filesystem_error& e) {
    WARN("skipped: this file system holds no sparse 40 GiB file: " << e.what());
    return;
  }
  CHECK_THROWS_WITH(safetensors::load(*lying), StartsWith(lying->string()) && Contains("run past the end of the file"));
  CHECK_THROWS_WITH(read_safetensors_header(*lying), Contains("run past the end of the file"));

  // A valid file larger than the cap: its header reads, the whole file does not.
  CHECK(read_safetensors_header(*exact).tensors.at(0).end == data);
  CHECK_THROWS_WITH(safetensors::load(*exact, std::uint64_t(1) << 30),
                    StartsWith(exact->string()) &&
                        Contains("bytes, more than the 1073741824 safetensors::load may hold in memory"));
  if (io::detail::physical_memory_bytes() < fs::file_size(*exact))  // else the default cap lets it load
    CHECK_THROWS_AS(safetensors::load(*exact), io_error);
}

// ---------------------------------------------------------------------------------------
// Random mutants: every one is either rejected with io_error or parses into a consistent file

namespace {

// "" when f, parsed from file, is internally consistent, else what is wrong.
std::string inconsistency(const safetensors& f, const std::vector<std::byte>& file) {
  const std::uint64_t data_start = 8 + get_le64(file);
  std::uint64_t covered = 0;
  for (const tensor_info& t : f.tensors()) {
    const auto b = f.bytes(t.name);
    if (t.begin != covered) return "ranges are not contiguous at " + t.name;
    if (t.end - t.begin != std::uint64_t(t.shape.numel()) * size_of(t.type)) return "size mismatch at " + t.name;
    if (b.size() != t.end - t.begin) return "bytes() size at " + t.name;
    if (!std::equal(b.begin(), b.end(), file.begin() + std::ptrdiff_t(data_start + t.begin)))
      return "bytes() content at " + t.name;
    if (&f.info(t.name) != &t) return "info() lookup at " + t.name;
    bool get_ok = true;
    visit_dtype(t.type, [&](auto v) {
      try {
        get_ok = f.get<decltype(v)>(t.name).size() == std::size_t(t.shape.numel());
      } catch (const io_error&) {  // BOOL bytes other than 0 or 1
      }
    });
    if (!get_ok) return "get() size at " + t.name;
    covered = t.end;
  }
  if (data_start + covered != file.size()) return "tensors do not cover the data section";
  return "";
}

const char* const fragments[] = {"\"",
                                 "{",
                                 "}",
                                 "[",
                                 "]",
                                 ",",
                                 ":",
                                 "0",
                                 "-1",
                                 "1.5",
                                 "1e400",
                                 "18446744073709551615",
                                 "9223372036854775808",
                                 "null",
                                 "true",
                                 " ",
                                 "\\",
                                 "\xff",
                                 "\\u0000",
                                 "\"F64\"",
                                 "\"BOOL\"",
                                 "\"dtype\":\"U8\",",
                                 "\"shape\":[],",
                                 "\"data_offsets\":[0,0]",
                                 "\"__metadata__\":{},",
                                 "\"__metadata__\":{\"k\":\"v\"},",
                                 "\"x\":{\"dtype\":\"I8\",\"shape\":[0],\"data_offsets\":[0,0]},",
                                 "\"y\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"};

// Applies one random mutation. Edits inside the header keep the size field in step
// so that many mutants get past the JSON parser into the semantic checks.
void mutate(std::vector<std::byte>& f, std::mt19937_64& rng) {
  const auto pick = [&](std::size_t n) { return std::size_t(rng() % n); };  // n > 0
  const std::uint64_t n = f.size() >= 8 ? get_le64(f) : 0;
  const std::size_t header_end = f.size() >= 8 ? std::size_t(std::min<std::uint64_t>(f.size(), 8 + n)) : 0;
  const bool has_header = header_end > 8;
  const auto header_pos = [&] { return 8 + pick(header_end - 8); };
  const auto resize_header = [&](std::int64_t delta) { set_le64(f, n + std::uint64_t(delta)); };

  switch (pick(10)) {
    case 0:  // flip a bit anywhere
      if (!f.empty()) f[pick(f.size())] ^= std::byte(1u << pick(8));
      break;
    case 1:  // overwrite a byte, mostly in the header
      if (has_header && pick(4) != 0)
        f[header_pos()] = std::byte(rng());
      else if (!f.empty())
        f[pick(f.size())] = std::byte(rng());
      break;
    case 2:  // truncate
      if (!f.empty()) f.resize(pick(f.size()));
      break;
    case 3:  // extend
      for (std::size_t i = 1 + pick(16); i > 0; --i) f.push_back(std::byte(pick(3) == 0 ? rng() : 0));
      break;
    case 4:  // rewrite the size field
      if (f.size() < 8) break;
      switch (pick(4)) {
        case 0: set_le64(f, rng()); break;
        case 1: set_le64(f, n + std::uint64_t(std::int64_t(pick(33)) - 16)); break;
        case 2: set_le64(f, f.size() - 8); break;
        default: f[pick(8)] = std::byte(rng()); break;
      }
      break;
    case 5: {  // splice a JSON fragment into the header
      if (!has_header) break;
      const std::string_view frag = fragments[pick(std::size(fragments))];
      const auto b = to_bytes(frag);
      f.insert(f.begin() + std::ptrdiff_t(header_pos()), b.begin(), b.end());
      resize_header(std::int64_t(b.size()));
      break;
    }
    case 6: {  // change, insert or delete a digit in the header (offsets, shapes)
      if (!has_header) break;
      std::vector<std::size_t> digits;
      for (std::size_t i = 8; i < header_end; ++i) {
        if (std::isdigit(std::to_integer<unsigned char>(f[i]))) digits.push_back(i);
      }
      if (digits.empty()) break;
      const std::size_t at = digits[pick(digits.size())];
      const auto d = std::byte('0' + pick(10));
      switch (pick(3)) {
        case 0: f[at] = d; break;
        case 1:
          f.insert(f.begin() + std::ptrdiff_t(at), d);
          resize_header(1);
          break;
        default:
          f.erase(f.begin() + std::ptrdiff_t(at));
          resize_header(-1);
          break;
      }
      break;
    }
    case 7: {  // delete a few header bytes
      if (!has_header) break;
      const std::size_t at = header_pos();
      const std::size_t len = std::min<std::size_t>(1 + pick(8), header_end - at);
      f.erase(f.begin() + std::ptrdiff_t(at), f.begin() + std::ptrdiff_t(at + len));
      resize_header(-std::int64_t(len));
      break;
    }
    case 8: {  // move one tensor's range, keeping its size: gaps, overlaps, ranges past the end
      if (!has_header) break;
      const std::string_view header(reinterpret_cast<const char*>(f.data()) + 8, header_end - 8);
      const std::string_view key = "\"data_offsets\":[";
      std::vector<std::size_t> starts;
      for (auto p = header.find(key); p != header.npos; p = header.find(key, p + 1)) starts.push_back(p + key.size());
      if (starts.empty()) break;
      const std::size_t first = starts[pick(starts.size())];
      const std::size_t last = header.find(']', first);
      std::uint64_t b = 0, e = 0;
      const auto [comma, ok1] = std::from_chars(header.data() + first, header.data() + header.size(), b);
      if (ok1 != std::errc{} || *comma != ',') break;
      if (std::from_chars(comma + 1, header.data() + header.size(), e).ec != std::errc{}) break;
      if (last == header.npos) break;
      const std::uint64_t shift = 1 + pick(8);
      const std::uint64_t nb = pick(2) == 0 && b >= shift ? b - shift : b + shift, ne = nb + (e - b);
      const auto repl = to_bytes(std::to_string(nb) + "," + std::to_string(ne));
      const auto at = f.begin() + std::ptrdiff_t(8 + first);
      f.erase(at, f.begin() + std::ptrdiff_t(8 + last));
      f.insert(f.begin() + std::ptrdiff_t(8 + first), repl.begin(), repl.end());
      resize_header(std::int64_t(repl.size()) - std::int64_t(last - first));
      break;
    }
    default: {  // grow or shrink the data section by a few bytes
      if (f.size() <= header_end) break;
      if (pick(2) == 0)
        f.resize(f.size() - std::min<std::size_t>(f.size() - header_end, 1 + pick(8)));
      else
        f.insert(f.begin() + std::ptrdiff_t(header_end + pick(f.size() - header_end)), 1 + pick(8), std::byte{0});
      break;
    }
  }
}

std::vector<std::vector<std::byte>> mutation_bases(const temp_dir& dir) {
  std::vector<std::vector<std::byte>> bases;
  const double d[] = {1.5, -2};
  const half h[] = {half(1.0f), half(-0.5f), half(2.0f)};
  const bool m[] = {true, false, true};
  const std::int64_t i[] = {1, -1};
  const float s[] = {3};

  safetensors_writer mixed;
  mixed.add<double>("model.weight", Shape{2, 1}, std::span(d));
  mixed.add<half>("model.bias", Shape{3}, std::span(h));
  mixed.add<bool>("mask", Shape{3}, std::span(m));
  mixed.add<float>("empty", Shape{2, 0}, {});
  mixed.add<float>("scalar", Shape{}, std::span(s));
  mixed.set_metadata("format", "pt");
  mixed.write(dir / "mixed.safetensors");
  bases.push_back(read_all(dir / "mixed.safetensors"));

  const std::int8_t i8[] = {-5};
  const std::uint8_t u8[] = {1, 2, 3, 4};
  const std::int16_t i16[] = {300, -300};
  const std::int32_t i32[] = {70000};
  safetensors_writer many;
  many.add<std::int64_t>("a", Shape{2}, std::span(i));
  many.add<std::int8_t>("b", Shape{1, 1, 1}, std::span(i8));
  many.add<bfloat16>("c", Shape{0}, {});
  many.add<std::uint8_t>("d", Shape{4}, std::span(u8));
  many.add<std::int16_t>("e", Shape{2}, std::span(i16));
  many.add<std::int32_t>("f", Shape{1}, std::span(i32));
  many.write(dir / "many.safetensors");
  bases.push_back(read_all(dir / "many.safetensors"));

  safetensors_writer{}.write(dir / "empty.safetensors");
  bases.push_back(read_all(dir / "empty.safetensors"));

  bases.push_back(
      make_file(R"({"b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]},"__metadata__":{"format":"pt"},)"
                R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                "\x00\x00\xc0\x3f\x00\x00\x00\xc0\x07\x00\xff\xff"s));
  return bases;
}

}  // namespace

TEST_CASE("random mutants are rejected with io_error or parse consistently", "[io][safetensors][mutation]") {
  temp_dir dir;
  const auto bases = mutation_bases(dir);
  for (const auto& b : bases) REQUIRE(inconsistency(safetensors::parse(b, "base"), b).empty());

  std::mt19937_64 rng(20240611);
  constexpr int mutants = 4000;
  int accepted = 0, rejected = 0, unchanged = 0;
  for (int k = 0; k < mutants; ++k) {
    std::vector<std::byte> f = bases[std::size_t(k) % bases.size()];
    for (int m = 1 + int(rng() % 3); m > 0; --m) mutate(f, rng);
    if (f == bases[std::size_t(k) % bases.size()]) ++unchanged;
    INFO("mutant " << k);

    std::string parse_message;
    try {
      const auto parsed = safetensors::parse(f, "mutant");
      ++accepted;
      REQUIRE(inconsistency(parsed, f) == "");
    } catch (const io_error& e) {
      ++rejected;
      parse_message = e.what();
      REQUIRE_THAT(parse_message, StartsWith("mutant: "));
    }

    // Every 8th mutant goes through the file readers too: they must agree with parse.
    if (k % 8 == 0) {
      const auto path = dir / "mutant.safetensors";
      write_all(path, f);
      try {
        const auto h = read_safetensors_header(path);
        REQUIRE(parse_message.empty());
        const auto loaded = safetensors::load(path);
        REQUIRE(h.tensors == loaded.tensors());
        REQUIRE(h.metadata == loaded.metadata());
      } catch (const io_error& e) {
        const std::string prefix = path.string() + ": ";
        REQUIRE_FALSE(parse_message.empty());
        REQUIRE_THAT(e.what(), StartsWith(prefix));
        REQUIRE(std::string(e.what()).substr(prefix.size()) == parse_message.substr(std::string("mutant: ").size()));
      }
    }
  }
  // The mutants must reach both outcomes often, or the test proves little.
  INFO("mutants: " << accepted << " accepted, " << rejected << " rejected, " << unchanged << " unchanged");
  CHECK(accepted + rejected == mutants);
  CHECK(accepted >= mutants / 40);
  CHECK(rejected >= mutants / 2);
  CHECK(unchanged < mutants / 10);
}

// ---------------------------------------------------------------------------------------
// State dicts: name maps, transposes, dtypes, ties, strictness, Hugging Face's layouts

namespace {

// Embedding [7, 5] -> two Linear(5, 5) -> Linear(5, 7): "0.weight", "1.layers.k.weight",
// "1.layers.k.bias", "2.weight", "2.bias"; odd sizes, so shards split parameters at W = 2, 3.
// Float masters (the engine's); the plain holder below covers double ones.
using Lm = nn::Sequential<nn::Embedding<float>, nn::Stack<nn::Linear<float>>, nn::Linear<float>>;
constexpr std::int64_t V = 7, D = 5;
Lm make_lm() {
  return Lm{nn::Embedding<float>(V, D), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(D, D)),
            nn::Linear<float>(D, V)};
}

// The file's side: GPT-2-like names, the hidden layers stored [in, out], mixed dtypes.
const name_map lm_names = name_map::table({{"transformer.wte.weight", "0.weight"},
                                           {"transformer.h.0.mlp.c_fc.weight", "1.layers.0.weight"},
                                           {"transformer.h.0.mlp.c_fc.bias", "1.layers.0.bias"},
                                           {"transformer.h.1.mlp.c_fc.weight", "1.layers.1.weight"},
                                           {"transformer.h.1.mlp.c_fc.bias", "1.layers.1.bias"},
                                           {"lm_head.weight", "2.weight"},
                                           {"lm_head.bias", "2.bias"}});
state_dict_options lm_options(bool strict = true) {
  return {.names = lm_names, .transposed = {"layers.0.weight", "layers.1.weight"}, .tied = {{"2.weight", "0.weight"}},
          .strict = strict};
}

// Values exact in every dtype used (eighths below 4): the expected loads are exact.
double value_of(int tensor, std::int64_t i) { return double((i * 7 + tensor * 3) % 29 - 14) / 8; }

struct file_tensor {
  std::string name;
  dtype type;
  Shape shape;
  int values = -1;             // it holds the values of the file's tensor number `values` (-1: its own)
  std::int64_t changed = -1;  // and this element 1/8 higher
};
const std::vector<file_tensor> lm_file = {{"transformer.wte.weight", dtype::f64, {V, D}},
                                          {"transformer.h.0.mlp.c_fc.weight", dtype::f32, {D, D}},
                                          {"transformer.h.0.mlp.c_fc.bias", dtype::f16, {D}},
                                          {"transformer.h.1.mlp.c_fc.weight", dtype::bf16, {D, D}},
                                          {"transformer.h.1.mlp.c_fc.bias", dtype::f32, {D}},
                                          {"lm_head.bias", dtype::f64, {V}}};  // lm_head.weight: tied, absent

void write_lm_file(const fs::path& file, const std::vector<file_tensor>& tensors = lm_file) {
  safetensors_writer w;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const auto& t = tensors[k];
    std::vector<std::byte> bytes;
    for (std::int64_t i = 0; i < t.shape.numel(); ++i)
      io::detail::append_converted(bytes, t.type, value_of(t.values < 0 ? int(k) : t.values, i) + (i == t.changed) / 8.0);
    w.add(t.name, t.type, t.shape, bytes);
  }
  w.write(file);
}

// What each model parameter must hold after loading lm_file: transposed where stored so,
// lm_head.weight from the embedding.
std::map<std::string, std::vector<double>> lm_expected() {
  const auto file = [](int k, std::int64_t n) {
    std::vector<double> v;
    for (std::int64_t i = 0; i < n; ++i) v.push_back(value_of(k, i));
    return v;
  };
  const auto transposed = [&](int k) {  // file [in, out] -> model [out, in]
    const auto f = file(k, D * D);
    std::vector<double> v(f.size());
    for (std::int64_t o = 0; o < D; ++o)
      for (std::int64_t i = 0; i < D; ++i) v[std::size_t(o * D + i)] = f[std::size_t(i * D + o)];
    return v;
  };
  return {{"0.weight", file(0, V * D)},      {"1.layers.0.weight", transposed(1)}, {"1.layers.0.bias", file(2, D)},
          {"1.layers.1.weight", transposed(3)}, {"1.layers.1.bias", file(4, D)},  {"2.weight", file(0, V * D)},
          {"2.bias", file(5, V)}};
}

template <class Owner>
std::map<std::string, std::vector<double>> values_of(Owner& owner) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& e : owner.layout().entries) {
    const auto v = owner.value(e.name);
    out[e.name].assign(v.begin(), v.end());
  }
  return out;
}

template <class Engine>
std::map<std::string, std::vector<double>> values_of_sharded(Engine& model) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& t : model.full_state_dict(false)) out[t.name].assign(t.value.span().begin(), t.value.span().end());
  return out;
}

// Rank 0's load report and values, kept for the assertions after launch (Catch is not
// thread-safe).
struct loaded {
  bool ok = false;
  std::vector<std::string> from_tied;
  std::map<std::string, std::vector<double>> values;
  template <class Report>
  void keep(const comm::ThreadComm& c, const Report& r, std::map<std::string, std::vector<double>> v) {
    if (c.rank() != 0) return;
    ok = r.ok();
    from_tied = r.from_tied;
    values = std::move(v);
  }
};

// Runs f(model) on every rank of a W-rank FullShard (each Linear a unit) or NoShard model.
template <class Strategy, class F>
void on_sharded_lm(int world, Strategy strategy, F&& f) {
  comm::launch(world, [&](comm::ThreadComm& c) {
    Lm m = make_lm();
    auto model =
        shard::fully_shard(m, c, strategy, {.wrap = shard::wrap_types<nn::Linear<float>>{}, .seed = 3});
    f(model, c);
  });
}

// A layer that only holds parameters under given names (the shapes of a file it mirrors).
template <class T>
struct holder {
  using input = Tensor<T>;
  using output = Tensor<T>;
  std::vector<std::pair<std::string, nn::Param<T>>> params;
  template <class V_>
  void parameters(V_&& v) {
    for (auto& [n, p] : params) v(n, p);
  }
  template <class Ctx>
  output forward(Ctx&, const input& x) { return x; }
  template <class Ctx>
  input backward(Ctx&, const output& dy) { return dy; }
};

// A holder with the parameters a Hugging Face file holds, in the model's layout, plus extra.
template <class T>
holder<T> mirror(const std::map<std::string, tensor_info>& tensors, const state_dict_options& o,
                 const std::vector<std::pair<std::string, Shape>>& extra = {}) {
  holder<T> h;
  for (const auto& [n, t] : tensors) {
    const bool transpose = t.shape.rank() == 2 && io::detail::ends_with_any(n, o.transposed);
    h.params.push_back({n, {.shape = transpose ? io::detail::reversed(t.shape) : t.shape, .init = {}}});
  }
  for (const auto& [n, s] : extra) h.params.push_back({n, {.shape = s, .init = {}}});
  return h;
}

// The tensors of one file, or of every file an index lists, with their values as double.
struct read_back {
  std::map<std::string, tensor_info> tensors;
  std::map<std::string, std::vector<double>> values;
  std::map<std::string, std::string> metadata;
};
read_back read_files(const std::vector<fs::path>& files) {
  read_back r;
  for (const auto& f : files) {
    const auto st = safetensors::load(f);
    for (const auto& t : st.tensors()) {
      r.tensors[t.name] = t;
      auto& v = r.values[t.name];
      visit_dtype(t.type, [&](auto x) {
        using E = decltype(x);
        if constexpr (FloatingElement<E>)
          for (E e : st.get<E>(t.name)) v.push_back(element_cast<double>(e));
      });
    }
    r.metadata = st.metadata();
  }
  return r;
}
std::vector<fs::path> shard_files(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

const fs::path hf_goldens = fs::path(__FILE__).parent_path().parent_path() / "golden" / "hf";

}  // namespace

TEST_CASE("a sharded model loads through a name map, transposes, dtypes and a tie at every world size",
          "[io][state_dict]") {
  temp_dir dir;
  write_lm_file(dir / "lm.safetensors");
  const auto want = lm_expected();
  for (int world : {1, 2, 3}) {
    INFO("W = " << world);
    loaded got;
    on_sharded_lm(world, shard::FullShard{}, [&](auto& model, comm::ThreadComm& c) {
      const auto r = load_state_dict(dir / "lm.safetensors", model, lm_options());
      got.keep(c, r, values_of_sharded(model));  // collective: every rank
    });
    CHECK(got.ok);
    CHECK(got.from_tied == std::vector<std::string>{"2.weight"});
    CHECK(got.values == want);
  }
  std::map<std::string, std::vector<double>> replicated;
  on_sharded_lm(2, shard::NoShard{}, [&](auto& model, comm::ThreadComm& c) {
    load_state_dict(dir / "lm.safetensors", model, lm_options());
    auto values = values_of_sharded(model);
    if (c.rank() == 0) replicated = std::move(values);
  });
  CHECK(replicated == want);
  Lm m = make_lm();
  nn::Replicated<float, Lm> plain(m, 3);
  load_state_dict(dir / "lm.safetensors", plain, lm_options());
  CHECK(values_of(plain) == want);
}

TEST_CASE("strict loads name every missing, unexpected and misshapen tensor, and non-strict ones report them",
          "[io][state_dict]") {
  temp_dir dir;
  auto bad = lm_file;
  bad.erase(bad.begin() + 2);                                       // transformer.h.0.mlp.c_fc.bias: missing
  bad[1].shape = {D, D + 1};                                         // c_fc.0 weight misshapen
  bad.push_back({"transformer.h.9.mlp.c_fc.bias", dtype::f32, {D}});  // unexpected
  write_lm_file(dir / "bad.safetensors", bad);
  const auto file = (dir / "bad.safetensors").string();

  Lm m = make_lm();
  nn::Replicated<float, Lm> plain(m, 3);
  const auto before = values_of(plain);
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.safetensors", plain, lm_options()),
                    StartsWith(file + ": does not match the model (strict load): ") &&
                        Contains("missing (1): 1.layers.0.bias") &&
                        Contains("unexpected (1): transformer.h.9.mlp.c_fc.bias") &&
                        Contains("shape mismatch (1): 1.layers.0.weight is [5, 6] in the file but [5, 5] in the "
                                 "model (stored transposed)"));
  CHECK(values_of(plain) == before);  // a failed load changes nothing

  const auto r = load_state_dict(dir / "bad.safetensors", plain, lm_options(false));
  CHECK(r.missing == std::vector<std::string>{"1.layers.0.bias"});
  CHECK(r.unexpected == std::vector<std::string>{"transformer.h.9.mlp.c_fc.bias"});
  CHECK(r.mismatched == std::vector<shape_mismatch>{{"1.layers.0.weight", {D, D + 1}, {D, D}, true}});
  auto after = values_of(plain), want = lm_expected();
  CHECK(after["1.layers.0.bias"] == before.at("1.layers.0.bias"));  // not loaded: unchanged
  CHECK(after["1.layers.0.weight"] == before.at("1.layers.0.weight"));
  CHECK(after["0.weight"] == want["0.weight"]);  // the rest loaded
  CHECK(after["2.weight"] == want["2.weight"]);

  // Without the tie, the absent lm_head.weight is missing; a second name for one parameter is an error.
  auto untied = lm_options(false);
  untied.tied.clear();
  CHECK(load_state_dict(dir / "bad.safetensors", plain, untied).missing ==
        std::vector<std::string>{"1.layers.0.bias", "2.weight"});
  const auto both = name_map::prefixes({{"transformer.h.9.", "1.layers.1."}, {"transformer.h.1.", "1.layers.1."}});
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.safetensors", plain, {.names = both}),
                    Contains("both map to the model's '1.layers.1.mlp.c_fc.bias'"));

  // An F64 value beyond float's range is an error, not an inf.
  safetensors_writer huge;
  huge.add<double>("transformer.wte.weight", {V, D}, std::vector<double>(V * D, 1e300));
  huge.write(dir / "huge.safetensors");
  CHECK_THROWS_WITH(load_state_dict(dir / "huge.safetensors", plain, lm_options(false)),
                    Contains("tensor \"transformer.wte.weight\" element 0 is 1e+300, beyond F32's range"));

  // Sharded: every rank raises, naming the file.
  std::vector<std::string> what(2);  // each rank's message, checked after (Catch is not thread-safe)
  on_sharded_lm(2, shard::FullShard{}, [&](auto& model, comm::ThreadComm& c) {
    try {
      load_state_dict(dir / "bad.safetensors", model, lm_options());
    } catch (const std::exception& e) {
      what[std::size_t(c.rank())] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    CHECK_THAT(what[std::size_t(r)],
               StartsWith("rank " + std::to_string(r) + ": loading " + file + ": " + file + ": does not match the model") &&
                   Contains("missing (1): 1.layers.0.bias"));
}

// One index maps names to files: a name in two files would lose one of them.
TEST_CASE("a sharded save refuses two parameters under one file name", "[io][state_dict]") {
  temp_dir dir;
  Lm m = make_lm();
  nn::Replicated<float, Lm> owner(m, 1);
  state_dict_options o;
  o.names = name_map([](std::string_view f) { return std::string(f); }, [](std::string_view) { return "x"s; });
  o.max_shard_bytes = 1;  // a file per tensor: no one file holds both
  CHECK_THROWS_WITH(save_state_dict(dir / "out", owner, o), Contains("two parameters are written under the name 'x'"));
  CHECK_FALSE(std::filesystem::exists(dir / "out"));
}

// F16 holds at most 65504: a larger weight saved in it is an error naming it, not an inf.
TEST_CASE("a save in F16 refuses values beyond its range", "[io][state_dict]") {
  temp_dir dir;
  Lm m = make_lm();
  nn::Replicated<float, Lm> owner(m, 1);
  owner.values()[owner.values().size() - 1] = 7e4f;
  CHECK_THROWS_WITH(save_state_dict(dir / "f16.safetensors", owner, {.save_dtype = dtype::f16}),
                    Contains("parameter '2.bias' holds 70000, beyond F16's range: it would be saved as inf"));
  CHECK_NOTHROW(save_state_dict(dir / "bf16.safetensors", owner, {.save_dtype = dtype::bf16}));  // bf16 reaches 3e38
}

TEST_CASE("save_state_dict writes the file's names, layouts and dtype, the tie once, and loads back",
          "[io][state_dict]") {
  temp_dir dir;
  write_lm_file(dir / "lm.safetensors");
  const auto want = lm_expected();
  for (int world : {1, 3}) {
    INFO("W = " << world);
    bool index_ok = false, file_ok = false;
    std::map<std::string, std::vector<double>> from_index, from_file;  // rank 0's, checked after launch
    on_sharded_lm(world, shard::FullShard{}, [&](auto& model, comm::ThreadComm& c) {
      load_state_dict(dir / "lm.safetensors", model, lm_options());
      auto f32 = lm_options();
      f32.save_dtype = dtype::f32;
      save_state_dict(dir / "out.safetensors", model, f32);
      auto sharded = lm_options();
      sharded.save_dtype = dtype::bf16;  // the values are exact in it
      sharded.max_shard_bytes = 80;  // BF16: the embedding (70 B), then 50 + 10, then 50 + 10 + 14
      save_state_dict(dir / "out", model, sharded);
      c.barrier();
      // And back: into a fresh model at another world size's layout, through the index.
      Lm m2 = make_lm();
      auto fresh = shard::fully_shard(m2, c, shard::ShardOptimizer{}, {.seed = 9});
      const bool index_loaded = load_state_dict(dir / "out", fresh, lm_options()).ok();
      auto index_values = values_of_sharded(fresh);
      const bool file_loaded = load_state_dict(dir / "out.safetensors", fresh, lm_options()).ok();
      auto file_values = values_of_sharded(fresh);
      if (c.rank() != 0) return;
      index_ok = index_loaded;
      file_ok = file_loaded;
      from_index = std::move(index_values);
      from_file = std::move(file_values);
    });
    CHECK(index_ok);
    CHECK(from_index == want);
    CHECK(file_ok);
    CHECK(from_file == want);
    // The file as another reader sees it: the file's names, [in, out] layouts, no lm_head.weight.
    const auto out = read_files({dir / "out.safetensors"});
    CHECK(out.metadata == std::map<std::string, std::string>{{"format", "pt"}});
    CHECK(out.tensors.size() == lm_file.size());
    for (std::size_t k = 0; k < lm_file.size(); ++k) {
      const auto& t = out.tensors.at(lm_file[k].name);
      CHECK(t.type == dtype::f32);
      CHECK(t.shape == lm_file[k].shape);
      std::vector<double> v;
      for (std::int64_t i = 0; i < t.shape.numel(); ++i) v.push_back(value_of(int(k), i));
      CHECK(out.values.at(lm_file[k].name) == v);
    }
    const auto files = shard_files(dir / "out");
    CHECK(files.size() == 3);
    CHECK(files[0].filename() == "model-00001-of-00003.safetensors");
    const auto sharded_back = read_files(files);
    CHECK(sharded_back.values == out.values);
    CHECK(sharded_back.tensors.at("transformer.wte.weight").type == dtype::bf16);
  }
  // Tied parameters that differ cannot be written once.
  Lm m = make_lm();
  nn::Replicated<float, Lm> plain(m, 3);
  CHECK_THROWS_WITH(save_state_dict(dir / "x.safetensors", plain, lm_options()),
                    Contains("tied parameters '2.weight' and '0.weight' hold different values"));
  CHECK(!fs::exists(dir / "x.safetensors"));
}

TEST_CASE("a model whose engine ties parameters loads and saves them once, under either name, the alias alone too",
          "[io][state_dict]") {
  temp_dir dir;
  auto hf = lm_file, both = lm_file;
  hf.pop_back();                                            // no lm_head at all, as Hugging Face writes it
  both.back() = {"lm_head.weight", dtype::f32, {V, D}, 0};  // PyTorch's state_dict lists a tied weight under both names
  write_lm_file(dir / "hf.safetensors", hf);
  write_lm_file(dir / "both.safetensors", both);
  const state_dict_options o{.names = lm_names, .transposed = {"layers.0.weight", "layers.1.weight"}};  // no tie given
  auto want = lm_expected();
  want.erase("2.bias");
  using TiedLm = nn::Sequential<nn::Embedding<float>, nn::Stack<nn::Linear<float>>, nn::TiedLinear<float>>;
  // Catch's assertions are not thread-safe: each rank records what it saw, checked after.
  std::vector<std::string> failures(2);
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto& why = failures[std::size_t(c.rank())];
    TiedLm m{nn::Embedding<float>(V, D), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(D, D)),
             nn::TiedLinear<float>(D, V)};
    m.get<2>().tie(m.get<0>().weight);
    auto model = shard::fully_shard(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<nn::Linear<float>>{}});
    for (const char* f : {"hf.safetensors", "both.safetensors"}) {
      const auto r = load_state_dict(dir / f, model, o);
      if (!r.ok()) why += cat(f, ": ", r.describe(), "; ");
      // "2.weight" is "0.weight": the layout's name is read
      if (values_of_sharded(model) != want) why += cat(f, ": values differ; ");
    }
    save_state_dict(dir / "out.safetensors", model, o);
    if (c.rank() == 0) {
      const auto out = read_files({dir / "out.safetensors"});
      if (out.tensors.size() != 5) why += cat(out.tensors.size(), " tensors saved, not 5; ");  // the tied weight once
      if (out.values.at("transformer.wte.weight") != want.at("0.weight")) why += "the tied weight's values differ; ";
      if (out.tensors.contains("lm_head.weight")) why += "lm_head.weight saved too; ";
    }
    // options.only taking the tie's alias and not its target: the alias is written
    auto head = o;
    head.only = {"2.*"};
    save_state_dict(dir / "head.safetensors", model, head);
    if (c.rank() == 0) {
      const auto out = read_files({dir / "head.safetensors"});
      if (out.tensors.size() != 1 || !out.tensors.contains("lm_head.weight"))
        why += cat(out.tensors.size(), " tensors saved for the head, not lm_head.weight alone; ");
      else if (out.values.at("lm_head.weight") != want.at("0.weight")) why += "the head's values differ; ";
    }
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << failures[std::size_t(r)]);
    CHECK(failures[std::size_t(r)].empty());
  }
}

// A file holding a tied weight under both names holds it twice: a model that keeps one
// parameter can take the file only if both copies are the same.
TEST_CASE("a tied parameter the file holds twice loads when both copies are equal and raises naming both when not",
          "[io][state_dict][tied]") {
  temp_dir dir;
  auto files = std::map<std::string, std::vector<file_tensor>>{};
  for (const char* f : {"equal", "differ_first", "differ_last", "misshapen"})
    files[f].assign(lm_file.begin(), lm_file.end() - 1);  // TiedLinear has no lm_head.bias
  files["equal"].push_back({"lm_head.weight", dtype::f32, {V, D}, 0});  // the F64 embedding's values in F32
  files["differ_first"].push_back({"lm_head.weight", dtype::bf16, {V, D}, 0, 0});
  files["differ_last"].push_back({"lm_head.weight", dtype::f32, {V, D}, 0, V * D - 1});
  files["misshapen"].push_back({"lm_head.weight", dtype::f32, {D, V}, 0});
  for (const auto& [name, tensors] : files) write_lm_file(dir.path / (name + ".safetensors"), tensors);
  const auto path = [&](const std::string& name) { return (dir.path / (name + ".safetensors")).string(); };
  const state_dict_options o{.names = lm_names, .transposed = {"layers.0.weight", "layers.1.weight"}};
  using TiedLm = nn::Sequential<nn::Embedding<float>, nn::Stack<nn::Linear<float>>, nn::TiedLinear<float>>;
  auto want = lm_expected();
  want.erase("2.bias");
  const auto differ = [&](const std::string& name, std::int64_t at) {
    return cat(path(name), ": tensors \"lm_head.weight\" and \"transformer.wte.weight\" are one tied parameter of the "
               "model ('0.weight') but hold different values (element ", at, ": ", value_of(0, at) + 0.125, " against ",
               value_of(0, at), "); load the file into a model that keeps them apart");
  };
  auto o_tied = o;  // the engine's tie declared again: still one copy to compare
  o_tied.tied = {{"2.weight", "0.weight"}};
  for (const auto& [world, o] : {std::pair{1, o}, {3, o}, {2, o_tied}}) {
    // Catch's assertions are not thread-safe: each rank records what it saw, checked after.
    std::vector<std::string> failures(std::size_t(world), "");
    comm::launch(world, [&](comm::ThreadComm& c) {
      auto& why = failures[std::size_t(c.rank())];
      TiedLm m{nn::Embedding<float>(V, D), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(D, D)),
               nn::TiedLinear<float>(D, V)};
      m.get<2>().tie(m.get<0>().weight);
      auto model = shard::fully_shard(m, c, shard::FullShard{}, {.wrap = shard::wrap_types<nn::Linear<float>>{}});
      if (const auto r = load_state_dict(path("equal"), model, o); !r.ok() || !r.from_tied.empty())
        why += cat("equal: ", r.describe(), "; ");
      if (values_of_sharded(model) != want) why += "equal: values differ; ";
      for (const auto& [name, at] : {std::pair{"differ_first"s, std::int64_t(0)}, {"differ_last"s, V * D - 1}}) {
        try {
          load_state_dict(path(name), model, o);
          why += cat(name, ": loaded; ");
        } catch (const io_error& e) {  // every rank raises, the one whose range holds the element and the others
          if (!std::string_view(e.what()).ends_with(differ(name, at) + " (an untied head: tie_word_embeddings false), "
                                                                        "or drop one of them"))
            why += cat(name, ": ", e.what(), "; ");
        }
        if (values_of_sharded(model) != want) why += cat(name, ": the failed load changed the model; ");
      }
      try {
        load_state_dict(path("misshapen"), model, o);
        why += "misshapen: loaded; ";
      } catch (const io_error& e) {
        if (!std::string_view(e.what()).ends_with("shape mismatch (1): 2.weight is [5, 7] in the file but [7, 5] in the model"))
          why += cat("misshapen: ", e.what(), "; ");
      }
    });
    for (int r = 0; r < world; ++r) {
      INFO("world " << world << ", rank " << r << ": " << failures[std::size_t(r)]);
      CHECK(failures[std::size_t(r)].empty());
    }
  }

  // A plain model's tie (a Param listed under two names) is compared the same way.
  TiedLm tied_m{nn::Embedding<float>(V, D), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(D, D)),
                nn::TiedLinear<float>(D, V)};
  tied_m.get<2>().tie(tied_m.get<0>().weight);
  nn::Replicated<float, TiedLm> plain_tied(tied_m, 3);
  auto want_plain = want;
  want_plain.erase("2.weight");  // laid out once, under its first name
  CHECK(load_state_dict(path("equal"), plain_tied, o).ok());
  CHECK(values_of(plain_tied) == want_plain);
  CHECK_THROWS_WITH(load_state_dict(path("differ_last"), plain_tied, o), EndsWith(differ("differ_last", V * D - 1) +
                    " (an untied head: tie_word_embeddings false), or drop one of them"));
  CHECK(values_of(plain_tied) == want_plain);
  auto only_head = files.at("equal");  // the embedding only under the head's name
  only_head.pop_back();
  only_head[0].name = "lm_head.weight";
  write_lm_file(dir.path / "only_head.safetensors", only_head);
  std::fill(plain_tied.values().begin(), plain_tied.values().end(), 0.0f);
  const auto from_head = load_state_dict(path("only_head"), plain_tied, o);
  CHECK(from_head.ok());
  CHECK(from_head.from_tied == std::vector<std::string>{"0.weight"});
  CHECK(values_of(plain_tied) == want_plain);

  // A tie the options declare for a name the model lacks (a body without the head, under
  // GPT-2's names) is not the model's: the file's lm_head.weight is not read, equal or not.
  using Body = nn::Sequential<nn::Embedding<float>, nn::Stack<nn::Linear<float>>>;
  Body body{nn::Embedding<float>(V, D), nn::Stack<nn::Linear<float>>(2, nn::Linear<float>(D, D))};
  nn::Replicated<float, Body> plain_body(body, 3);
  CHECK(load_state_dict(path("differ_first"), plain_body, lm_options()).ok());
  CHECK(values_of(plain_body).at("0.weight") == want.at("0.weight"));

  // A misshapen tensor two of the model's parameters read is reported under each.
  auto misshapen_wte = lm_file;
  misshapen_wte[0].shape = {D, V};
  write_lm_file(dir.path / "misshapen_wte.safetensors", misshapen_wte);
  Lm m = make_lm();
  nn::Replicated<float, Lm> plain(m, 3);
  CHECK(load_state_dict(path("misshapen_wte"), plain, lm_options(false)).mismatched ==
        std::vector<shape_mismatch>{{"0.weight", {D, V}, {V, D}, false}, {"2.weight", {D, V}, {V, D}, false}});
}

TEST_CASE("Hugging Face's sharded index: shards are found by name and a bad index is refused", "[io][state_dict]") {
  temp_dir dir;
  auto first = lm_file;
  first.resize(3);
  write_lm_file(dir / "a.safetensors", first);
  write_lm_file(dir / "b.safetensors", lm_file);
  // b holds every tensor (values depend on the position, the same in both); the index
  // takes the first three from a, the rest from b.
  std::string index = R"({"metadata": {"total_size": 0}, "weight_map": {)";
  for (std::size_t k = 0; k < lm_file.size(); ++k)
    index += (k ? "," : "") + ("\"" + lm_file[k].name + "\": \"") + (k < 3 ? "a" : "b") + ".safetensors\"";
  write_all(dir / "model.safetensors.index.json", to_bytes(index + "}}"));
  Lm m = make_lm();
  nn::Replicated<float, Lm> plain(m, 3);
  CHECK(load_state_dict(dir.path, plain, lm_options()).ok());
  CHECK(values_of(plain) == lm_expected());

  write_all(dir / "bad.json", to_bytes(R"({"weight_map": {"lm_head.bias": "../b.safetensors"}})"));
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.json", plain, lm_options()),
                    Contains("\"../b.safetensors\" is not a file name beside the index"));
  write_all(dir / "bad.json", to_bytes(R"({"weight_map": {"lm_head.weight": "a.safetensors"}})"));
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.json", plain, lm_options()),
                    Contains("maps tensor \"lm_head.weight\" to a.safetensors, which does not hold it"));
  CHECK_THROWS_WITH(load_state_dict(dir / "a.safetensors.missing", plain, lm_options()), Contains("cannot open"));
  write_all(dir / "bad.json",
            to_bytes(R"({"weight_map": {"lm_head.bias": "a.safetensors", "lm_head.bias": "b.safetensors"}})"));
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.json", plain, lm_options()),
                    Contains(R"(duplicate key "lm_head.bias" in the index)"));
  write_all(dir / "bad.json", to_bytes(R"({"weight_map": {}, "metadata": )" + std::string(100'000, '[') +
                                       std::string(100'000, ']') + "}"));
  CHECK_THROWS_WITH(load_state_dict(dir / "bad.json", plain, lm_options()),
                    StartsWith((dir / "bad.json").string()) &&
                        Contains("the index is not valid JSON here: it nests objects and arrays deeper than 512"));
}

TEST_CASE("files transformers wrote load with the Hugging Face conventions, and save back the same",
          "[io][state_dict][hf]") {
  temp_dir dir;
  // GPT-2: one file, Conv1D weights transposed, lm_head.weight absent (tied to transformer.wte.weight).
  const auto gpt2_dir = hf_goldens / "gpt2" / "initial";
  const auto gpt2 = read_files({gpt2_dir / "model.safetensors"});
  REQUIRE(gpt2.tensors.size() == 28);  // 2 + 12 per block + ln_f's 2
  CHECK(!gpt2.tensors.contains("lm_head.weight"));
  CHECK(gpt2.tensors.at("transformer.h.0.attn.c_attn.weight").shape == Shape{32, 96});  // [in, out]
  loaded loaded_gpt2;
  comm::launch(2, [&](comm::ThreadComm& c) {
    auto h = mirror<float>(gpt2.tensors, io::hf::gpt2(), {{"lm_head.weight", {96, 32}}});
    auto model = shard::fully_shard(h, c, shard::FullShard{});
    const auto r = load_state_dict(gpt2_dir, model, io::hf::gpt2());
    loaded_gpt2.keep(c, r, values_of_sharded(model));  // collective: every rank
    save_state_dict(dir / "gpt2.safetensors", model, io::hf::gpt2());
  });
  CHECK(loaded_gpt2.ok);
  CHECK(loaded_gpt2.from_tied == std::vector<std::string>{"lm_head.weight"});
  const auto& got = loaded_gpt2.values;
  CHECK(got.at("lm_head.weight") == gpt2.values.at("transformer.wte.weight"));
  const auto& w = got.at("transformer.h.1.mlp.c_fc.weight");  // [128, 32] here, [32, 128] in the file
  const auto& f = gpt2.values.at("transformer.h.1.mlp.c_fc.weight");
  CHECK(w[3 * 32 + 5] == f[5 * 128 + 3]);
  CHECK(got.at("transformer.h.0.ln_1.bias") == gpt2.values.at("transformer.h.0.ln_1.bias"));
  const auto back = read_files({dir / "gpt2.safetensors"});
  CHECK(back.values == gpt2.values);  // every tensor, bit for bit, under the same names and shapes
  CHECK(back.tensors.size() == gpt2.tensors.size());
  for (const auto& [n, t] : gpt2.tensors) {
    CHECK(back.tensors.at(n).shape == t.shape);
    CHECK(back.tensors.at(n).type == dtype::f32);  // as save_pretrained writes a float32 model
  }
  CHECK(back.metadata == gpt2.metadata);  // {"format": "pt"}

  // A GPT2Model file (no "transformer." prefix, with the causal-mask buffers) loads too.
  {
    safetensors_writer w;
    const auto& wte = gpt2.values.at("transformer.wte.weight");
    w.add<double>("wte.weight", {96, 32}, wte);
    w.add<float>("h.0.attn.bias", {1, 1, 2, 2}, std::vector<float>{1, 0, 1, 1});
    w.write(dir / "gpt2model.safetensors");
    auto h = mirror<double>({{"transformer.wte.weight", gpt2.tensors.at("transformer.wte.weight")}}, io::hf::gpt2());
    nn::Replicated<double, holder<double>> plain(h, 0);
    CHECK(load_state_dict(dir / "gpt2model.safetensors", plain, io::hf::gpt2()).ok());
    const auto v = plain.value("transformer.wte.weight");
    CHECK(std::vector<double>(v.begin(), v.end()) == wte);
  }

  // LLaMA: transformers' sharded layout (4 files and the index), untied lm_head.
  const auto llama_dir = hf_goldens / "llama" / "initial";
  const auto llama = read_files(shard_files(llama_dir));
  REQUIRE(llama.tensors.size() == 21);  // embed, 9 per layer, norm, lm_head
  auto h = mirror<double>(llama.tensors, io::hf::llama());  // double masters, from the F32 file
  nn::Replicated<double, holder<double>> plain(h, 0);
  CHECK(load_state_dict(llama_dir, plain, io::hf::llama()).ok());
  CHECK(values_of(plain) == llama.values);
  {  // a file converted by transformers < 4.31 holds RoPE's inv_freq buffers: ignored
    safetensors_writer w;
    for (const auto& [n, t] : llama.tensors)
      w.add<double>(n, t.shape, llama.values.at(n));
    w.add<float>("model.layers.0.self_attn.rotary_emb.inv_freq", {4}, std::vector<float>{1, 0.1f, 0.01f, 0.001f});
    w.write(dir / "old_llama.safetensors");
    const auto r = load_state_dict(dir / "old_llama.safetensors", plain, io::hf::llama());
    CHECK(r.ok());
    CHECK(r.unexpected.empty());
  }
  save_state_dict(dir / "llama", plain, {.save_dtype = dtype::f32, .max_shard_bytes = 40'000});
  CHECK(read_files(shard_files(dir / "llama")).values == llama.values);
  // A directory that cannot be made is an io_error naming it, not std::filesystem's error.
  write_all(dir / "a-file", to_bytes("x"));
  CHECK_THROWS_MATCHES(save_state_dict(dir / "a-file" / "llama", plain, {.max_shard_bytes = 40'000}), io_error,
                       Catch::Matchers::Message((dir / "a-file" / "llama").string() +
                                                ": cannot create the directory: Not a directory"));
}

}  // namespace test_safetensors
