// GGUF version 3 (tapegrad/gguf.h): a writer that lays tensors out as ggml's own writer does
// (in order, each at the next multiple of the alignment, zero padding between), and a reader that
// checks every count, length and offset against the bytes that are left before it allocates.
#include "tapegrad/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <system_error>

#include "atomic_file.h"

namespace tg {

static_assert(std::endian::native == std::endian::little, "GGUF I/O copies tensor data as little-endian bytes");

namespace {

template <class... Parts>
[[noreturn]] void fail_at(const std::string& ctx, const Parts&... parts) {
  std::ostringstream s;
  s << ctx << ": ";
  (s << ... << parts);
  throw Error(s.str());
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// Bytes of a scalar of type t; 0 for string and array.
std::size_t scalar_size(GGUFType t) {
  switch (t) {
    case GGUFType::u8: case GGUFType::i8: case GGUFType::boolean: return 1;
    case GGUFType::u16: case GGUFType::i16: return 2;
    case GGUFType::u32: case GGUFType::i32: case GGUFType::f32: return 4;
    case GGUFType::u64: case GGUFType::i64: case GGUFType::f64: return 8;
    case GGUFType::string: case GGUFType::array: return 0;
  }
  return 0;
}

bool is_valid_type(std::uint32_t t) { return t <= static_cast<std::uint32_t>(GGUFType::f64); }
bool is_signed(GGUFType t) {
  return t == GGUFType::i8 || t == GGUFType::i16 || t == GGUFType::i32 || t == GGUFType::i64;
}
bool is_unsigned(GGUFType t) {
  return t == GGUFType::u8 || t == GGUFType::u16 || t == GGUFType::u32 || t == GGUFType::u64;
}

void put_le(std::string& out, std::uint64_t v, std::size_t bytes) {
  for (std::size_t b = 0; b < bytes; ++b) out += static_cast<char>((v >> (8 * b)) & 0xff);
}

std::uint64_t get_le(const unsigned char* p, std::size_t bytes) {
  std::uint64_t v = 0;
  for (std::size_t b = bytes; b-- > 0;) v = (v << 8) | p[b];
  return v;
}

// ggml's tensor types by number (those tapegrad reads, and the names of the others for errors).
constexpr std::uint32_t kGgmlF32 = 0, kGgmlI32 = 26, kGgmlF64 = 28, kGgmlBF16 = 30;

const char* ggml_type_name(std::uint32_t t) {
  static const char* const kNames[] = {
      "F32",  "F16",     "Q4_0",   "Q4_1",    nullptr, nullptr, "Q5_0",  "Q5_1",  "Q8_0",   "Q8_1",
      "Q2_K", "Q3_K",    "Q4_K",   "Q5_K",    "Q6_K",  "Q8_K",  "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
      "IQ4_NL", "IQ3_S", "IQ2_S",  "IQ4_XS",  "I8",    "I16",   "I32",   "I64",   "F64",    "IQ1_M",
      "BF16", nullptr,   nullptr,  nullptr,   "TQ1_0", "TQ2_0", nullptr, nullptr, nullptr,  "MXFP4"};
  return t < std::size(kNames) ? kNames[t] : nullptr;
}

bool ggml_to_dtype(std::uint32_t t, DType* out) {
  switch (t) {
    case kGgmlF32: *out = float32; return true;
    case kGgmlBF16: *out = bfloat16; return true;
    case kGgmlF64: *out = float64; return true;
    case kGgmlI32: *out = int32; return true;
  }
  return false;
}

std::uint32_t dtype_to_ggml(DType d) {
  switch (d) {
    case float32: return kGgmlF32;
    case bfloat16: return kGgmlBF16;
    case float64: return kGgmlF64;
    case int32: return kGgmlI32;
  }
  return kGgmlF32;
}

std::uint64_t align_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

// The alignment a metadata set asks for: "general.alignment", a UINT32 power of two up to
// kGGUFMaxAlignment, else 32.
std::uint64_t alignment_of(const GGUFMetadata& md, const std::string& ctx) {
  const GGUFValue* v = md.find("general.alignment");
  if (!v) return kGGUFDefaultAlignment;
  if (v->type() != GGUFType::u32)
    fail_at(ctx, "general.alignment is ", gguf_type_name(v->type()), ", not UINT32");
  const std::uint64_t a = v->as_uint("general.alignment");
  if (a == 0 || (a & (a - 1)) != 0) fail_at(ctx, "general.alignment ", a, " is not a power of two");
  if (a > kGGUFMaxAlignment)
    fail_at(ctx, "general.alignment ", a, " exceeds the limit of ", kGGUFMaxAlignment,
            " bytes (the padding after the header and after every tensor)");
  return a;
}

}  // namespace

const char* gguf_type_name(GGUFType t) {
  static const char* const kNames[] = {"UINT8", "INT8",  "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
                                       "BOOL",  "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "?";
}

// ---------------------------------------------------------------------------------------------
// GGUFValue and GGUFMetadata

// Builds values from their parts; also the reader's and the writer's access to the raw bytes.
class GGUFCodec {
 public:
  static GGUFValue scalar(GGUFType t, std::uint64_t bits) {
    GGUFValue v;
    v.type_ = t;
    v.raw_.clear();
    put_le(v.raw_, bits, scalar_size(t));
    return v;
  }
  static GGUFValue numbers(GGUFType element, std::string raw) {
    GGUFValue v;
    v.type_ = GGUFType::array;
    v.element_ = element;
    v.raw_ = std::move(raw);
    return v;
  }
  static GGUFValue string(std::string s) {
    GGUFValue v;
    v.type_ = GGUFType::string;
    v.str_ = std::move(s);
    return v;
  }
  static GGUFValue strings(std::vector<std::string> s) {
    GGUFValue v;
    v.type_ = GGUFType::array;
    v.element_ = GGUFType::string;
    v.strings_ = std::move(s);
    return v;
  }
  static const std::string& raw(const GGUFValue& v) { return v.raw_; }
  static const std::string& str(const GGUFValue& v) { return v.str_; }
  static const std::vector<std::string>& strs(const GGUFValue& v) { return v.strings_; }
};

GGUFValue GGUFValue::of_u32(std::uint32_t v) { return GGUFCodec::scalar(GGUFType::u32, v); }
GGUFValue GGUFValue::of_i32(std::int32_t v) {
  return GGUFCodec::scalar(GGUFType::i32, static_cast<std::uint32_t>(v));
}
GGUFValue GGUFValue::of_u64(std::uint64_t v) { return GGUFCodec::scalar(GGUFType::u64, v); }
GGUFValue GGUFValue::of_f32(float v) { return GGUFCodec::scalar(GGUFType::f32, std::bit_cast<std::uint32_t>(v)); }
GGUFValue GGUFValue::of_f64(double v) { return GGUFCodec::scalar(GGUFType::f64, std::bit_cast<std::uint64_t>(v)); }
GGUFValue GGUFValue::of_bool(bool v) { return GGUFCodec::scalar(GGUFType::boolean, v ? 1 : 0); }
GGUFValue GGUFValue::of_string(std::string v) { return GGUFCodec::string(std::move(v)); }
GGUFValue GGUFValue::strings(std::vector<std::string> v) { return GGUFCodec::strings(std::move(v)); }

GGUFValue GGUFValue::f32s(const std::vector<float>& v) {
  std::string raw;
  raw.reserve(v.size() * 4);
  for (float x : v) put_le(raw, std::bit_cast<std::uint32_t>(x), 4);
  return GGUFCodec::numbers(GGUFType::f32, std::move(raw));
}

GGUFValue GGUFValue::i32s(const std::vector<std::int32_t>& v) {
  std::string raw;
  raw.reserve(v.size() * 4);
  for (std::int32_t x : v) put_le(raw, static_cast<std::uint32_t>(x), 4);
  return GGUFCodec::numbers(GGUFType::i32, std::move(raw));
}

std::size_t GGUFValue::size() const {
  if (type_ != GGUFType::array) return 1;
  if (element_ == GGUFType::string) return strings_.size();
  return raw_.size() / scalar_size(element_);
}

GGUFValue GGUFValue::item(std::size_t i, const std::string& what) const {
  if (type_ != GGUFType::array || element_ == GGUFType::string)
    fail(what.c_str(), "is ", gguf_type_name(type_), type_ == GGUFType::array ? " of STRING" : "",
         ", not an array of numbers");
  if (i >= size()) fail(what.c_str(), "index ", i, " is past the array's ", size(), " elements");
  const std::size_t k = scalar_size(element_);
  return GGUFCodec::scalar(element_, get_le(reinterpret_cast<const unsigned char*>(raw_.data()) + i * k, k));
}

std::uint64_t GGUFValue::as_uint(const std::string& what) const {
  if (is_unsigned(type_)) return get_le(reinterpret_cast<const unsigned char*>(raw_.data()), raw_.size());
  if (!is_signed(type_)) fail(what.c_str(), "is ", gguf_type_name(type_), ", not an integer");
  const std::int64_t v = as_int(what);
  if (v < 0) fail(what.c_str(), "is ", v, ", not a non-negative integer");
  return static_cast<std::uint64_t>(v);
}

std::int64_t GGUFValue::as_int(const std::string& what) const {
  const std::size_t k = scalar_size(type_);
  if (is_signed(type_)) {
    const std::uint64_t bits = get_le(reinterpret_cast<const unsigned char*>(raw_.data()), k);
    const unsigned shift = static_cast<unsigned>(64 - 8 * k);
    return static_cast<std::int64_t>(bits << shift) >> shift;  // sign extension
  }
  const std::uint64_t u = as_uint(what);
  if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    fail(what.c_str(), "is ", u, ", too large for a signed 64-bit integer");
  return static_cast<std::int64_t>(u);
}

double GGUFValue::as_double(const std::string& what) const {
  const auto* p = reinterpret_cast<const unsigned char*>(raw_.data());
  if (type_ == GGUFType::f32) return std::bit_cast<float>(static_cast<std::uint32_t>(get_le(p, 4)));
  if (type_ == GGUFType::f64) return std::bit_cast<double>(get_le(p, 8));
  if (is_signed(type_)) return static_cast<double>(as_int(what));
  if (is_unsigned(type_)) return static_cast<double>(as_uint(what));
  fail(what.c_str(), "is ", gguf_type_name(type_), ", not a number");
}

bool GGUFValue::as_bool(const std::string& what) const {
  if (type_ != GGUFType::boolean) fail(what.c_str(), "is ", gguf_type_name(type_), ", not BOOL");
  return raw_[0] != 0;
}

const std::string& GGUFValue::as_string(const std::string& what) const {
  if (type_ != GGUFType::string) fail(what.c_str(), "is ", gguf_type_name(type_), ", not STRING");
  return str_;
}

const std::vector<std::string>& GGUFValue::as_strings(const std::string& what) const {
  if (type_ != GGUFType::array || element_ != GGUFType::string)
    fail(what.c_str(), "is ", gguf_type_name(type_), type_ == GGUFType::array ? " of " : "",
         type_ == GGUFType::array ? gguf_type_name(element_) : "", ", not an array of STRING");
  return strings_;
}

void GGUFMetadata::set(const std::string& key, GGUFValue v) {
  const auto [it, added] = index_.emplace(key, items_.size());
  if (added) items_.emplace_back(key, std::move(v));
  else items_[it->second].second = std::move(v);
}

const GGUFValue* GGUFMetadata::find(const std::string& key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

const GGUFValue& GGUFMetadata::at(const std::string& key) const {
  const GGUFValue* v = find(key);
  if (!v) fail("gguf", "no metadata key '", key, "'");
  return *v;
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

void put_string(std::string& out, const std::string& s) {
  put_le(out, s.size(), 8);
  out += s;
}

void put_value(std::string& out, const GGUFValue& v) {
  put_le(out, static_cast<std::uint32_t>(v.type()), 4);
  if (v.type() == GGUFType::string) return put_string(out, GGUFCodec::str(v));
  if (v.type() != GGUFType::array) {
    out += GGUFCodec::raw(v);
    return;
  }
  put_le(out, static_cast<std::uint32_t>(v.element_type()), 4);
  put_le(out, v.size(), 8);
  if (v.element_type() == GGUFType::string) {
    for (const std::string& s : GGUFCodec::strs(v)) put_string(out, s);
  } else {
    out += GGUFCodec::raw(v);
  }
}

void check_tensor(const std::string& name, const Tensor& t, const std::string& ctx) {
  if (name.empty() || name.size() > kGGUFMaxName)
    fail_at(ctx, "tensor name '", name, "' has ", name.size(), " bytes; GGUF (ggml) takes 1 to ", kGGUFMaxName);
  if (!t.defined()) fail_at(ctx, "tensor '", name, "' is undefined");
  if (t.dim() < 1 || t.dim() > kGGUFMaxDims)
    fail_at(ctx, "tensor '", name, "' has ", t.dim(), " dims; GGUF (ggml) takes 1 to ", kGGUFMaxDims);
}

// Everything before the data block: header, metadata, tensor infos, padding. Fills offsets with
// each tensor's place in the data block, then the block's size.
std::string make_header(const StateDict& tensors, const GGUFMetadata& md, std::uint64_t align,
                        std::vector<std::uint64_t>& offsets, const std::string& ctx) {
  std::string out = "GGUF";
  put_le(out, kGGUFVersion, 4);
  put_le(out, tensors.size(), 8);
  put_le(out, md.size(), 8);
  for (const auto& [key, v] : md) {
    if (key.empty()) fail_at(ctx, "a metadata key is empty");
    if (v.type() == GGUFType::array && v.element_type() == GGUFType::array)
      fail_at(ctx, "metadata '", key, "' is an array of arrays, which ggml does not read");
    put_string(out, key);
    put_value(out, v);
  }
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    check_tensor(name, t, ctx);
    put_string(out, name);
    put_le(out, static_cast<std::uint32_t>(t.dim()), 4);
    for (int d = t.dim() - 1; d >= 0; --d) put_le(out, static_cast<std::uint64_t>(t.size(d)), 8);
    put_le(out, dtype_to_ggml(t.dtype()), 4);
    put_le(out, offset, 8);
    offsets.push_back(offset);
    offset = align_up(offset + t.nbytes(), align);
  }
  offsets.push_back(offset);  // the data block's size
  out.append(align_up(out.size(), align) - out.size(), '\0');
  return out;
}

// Calls sink(ptr, n) with the data block: each tensor little-endian, then its zero padding in one
// piece (a padding is below the alignment, at most kGGUFMaxAlignment bytes).
template <class Sink>
void emit_data(const StateDict& tensors, const std::vector<std::uint64_t>& offsets, Sink&& sink) {
  std::vector<std::uint64_t> pads;
  for (const auto& [name, t] : tensors) pads.push_back(offsets[pads.size() + 1] - offsets[pads.size()] - t.nbytes());
  const std::string zeros(static_cast<std::size_t>(pads.empty() ? 0 : *std::max_element(pads.begin(), pads.end())), '\0');
  std::size_t i = 0;
  for (const auto& [name, t] : tensors) {
    (void)name;
    if (t.nbytes()) sink(static_cast<const char*>(t.raw_data()), t.nbytes());
    if (pads[i]) sink(zeros.data(), static_cast<std::size_t>(pads[i]));
    ++i;
  }
}

struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string to_gguf_bytes(const StateDict& tensors, const GGUFMetadata& metadata) {
  const std::string ctx = "to_gguf_bytes";
  std::vector<std::uint64_t> offsets;
  std::string out = make_header(tensors, metadata, alignment_of(metadata, ctx), offsets, ctx);
  out.reserve(out.size() + offsets.back());
  emit_data(tensors, offsets, [&](const char* p, std::size_t n) { out.append(p, n); });
  return out;
}

void save_gguf(const std::string& path, const StateDict& tensors, const GGUFMetadata& metadata) {
  const std::string ctx = "save_gguf: '" + path + "'";
  std::vector<std::uint64_t> offsets;
  const std::string header = make_header(tensors, metadata, alignment_of(metadata, ctx), offsets, ctx);
  detail::write_atomically(path, ctx, [&](int fd) {
    detail::write_all(fd, header.data(), header.size(), ctx);
    emit_data(tensors, offsets, [&](const char* p, std::size_t n) { detail::write_all(fd, p, n, ctx); });
  });
}

// ---------------------------------------------------------------------------------------------
// Reading

namespace {

// A bounds-checked reader over the file's bytes; every read names what it reads.
class Cursor {
 public:
  Cursor(const unsigned char* p, std::size_t n, std::string ctx) : p_(p), n_(n), ctx_(std::move(ctx)) {}
  std::uint64_t left() const { return n_ - pos_; }
  std::uint64_t pos() const { return pos_; }
  const std::string& ctx() const { return ctx_; }
  void need(std::uint64_t k, const std::string& what) const {
    if (k > left())
      fail_at(ctx_, "truncated: ", what, " needs ", k, " bytes at offset ", pos_, " but only ", left(), " remain");
  }
  std::uint64_t uint(std::size_t bytes, const std::string& what) {
    need(bytes, what);
    const std::uint64_t v = get_le(p_ + pos_, bytes);
    pos_ += bytes;
    return v;
  }
  std::string bytes(std::uint64_t k, const std::string& what) {
    need(k, what);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(k));
    pos_ += k;
    return s;
  }
  std::string string(const std::string& what) {
    const std::uint64_t len = uint(8, what + "'s length");
    return bytes(len, what + " (" + std::to_string(len) + " bytes)");
  }

 private:
  const unsigned char* p_;
  std::uint64_t n_, pos_ = 0;
  std::string ctx_;
};

GGUFType read_type(Cursor& c, const std::string& what) {
  const auto t = static_cast<std::uint32_t>(c.uint(4, what + "'s type"));
  if (!is_valid_type(t)) fail_at(c.ctx(), what, ": unknown value type ", t, " (GGUF has 0 to 12)");
  return static_cast<GGUFType>(t);
}

GGUFValue read_scalar(Cursor& c, GGUFType t, const std::string& what) {
  const std::uint64_t bits = c.uint(scalar_size(t), what);
  if (t == GGUFType::boolean && bits > 1) fail_at(c.ctx(), what, ": BOOL byte is ", bits, ", not 0 or 1");
  return GGUFCodec::scalar(t, bits);
}

GGUFValue read_array(Cursor& c, const std::string& what) {
  const GGUFType elem = read_type(c, what + "'s element");
  if (elem == GGUFType::array) fail_at(c.ctx(), what, ": arrays of arrays are not supported (ggml refuses them)");
  const std::uint64_t n = c.uint(8, what + "'s length");
  const std::uint64_t min_size = elem == GGUFType::string ? 8 : scalar_size(elem);
  if (n > c.left() / min_size)
    fail_at(c.ctx(), what, ": array of ", n, " ", gguf_type_name(elem), " cannot fit in the ", c.left(),
            " bytes that remain");
  if (elem != GGUFType::string) {
    std::string raw = c.bytes(n * min_size, what);
    if (elem == GGUFType::boolean)
      for (char b : raw)
        if (b != 0 && b != 1) fail_at(c.ctx(), what, ": BOOL element is ", int(b), ", not 0 or 1");
    return GGUFCodec::numbers(elem, std::move(raw));
  }
  std::vector<std::string> items;
  items.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t i = 0; i < n; ++i) items.push_back(c.string(what + "[" + std::to_string(i) + "]"));
  return GGUFCodec::strings(std::move(items));
}

GGUFMetadata read_metadata(Cursor& c, std::uint64_t n_kv) {
  GGUFMetadata md;
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = c.string("metadata key " + std::to_string(i));
    if (key.empty()) fail_at(c.ctx(), "metadata key ", i, " is empty");
    if (md.contains(key)) fail_at(c.ctx(), "duplicate metadata key '", key, "'");
    const std::string what = "metadata '" + key + "'";
    const GGUFType t = read_type(c, what);
    if (t == GGUFType::string) md.set(key, GGUFCodec::string(c.string(what)));
    else if (t == GGUFType::array) md.set(key, read_array(c, what));
    else md.set(key, read_scalar(c, t, what));
  }
  return md;
}

struct Info {
  std::string name;
  DType dtype = float32;
  Shape shape;
  std::uint64_t offset = 0, nbytes = 0;
};

std::string ne_text(const std::vector<std::uint64_t>& ne) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < ne.size(); ++i) s << (i ? ", " : "") << ne[i];
  return s.str() + ']';
}

// Reads ne[n_dims] and returns the element count, refusing an overflow of int64.
std::uint64_t read_dims(Cursor& c, const std::string& what, std::vector<std::uint64_t>& ne) {
  const auto n_dims = c.uint(4, what + "'s n_dims");
  if (n_dims < 1 || n_dims > static_cast<std::uint64_t>(kGGUFMaxDims))
    fail_at(c.ctx(), what, ": n_dims is ", n_dims, ", GGUF (ggml) takes 1 to ", kGGUFMaxDims);
  constexpr std::uint64_t kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t numel = 1;
  for (std::uint64_t d = 0; d < n_dims; ++d) {
    ne.push_back(c.uint(8, what + "'s ne[" + std::to_string(d) + "]"));
    if (ne.back() > kMax || (ne.back() != 0 && numel > kMax / ne.back()))
      fail_at(c.ctx(), what, ": dims ", ne_text(ne), " overflow (more than 2^63 elements)");
    numel *= ne.back();
  }
  return numel;
}

Info read_info(Cursor& c, std::uint64_t index) {
  Info in;
  in.name = c.string("tensor info " + std::to_string(index) + "'s name");
  if (in.name.empty() || in.name.size() > kGGUFMaxName)
    fail_at(c.ctx(), "tensor info ", index, ": name of ", in.name.size(), " bytes (ggml takes 1 to ", kGGUFMaxName, ")");
  const std::string what = "tensor '" + in.name + "'";
  std::vector<std::uint64_t> ne;
  const std::uint64_t numel = read_dims(c, what, ne);
  const auto type = static_cast<std::uint32_t>(c.uint(4, what + "'s type"));
  if (!ggml_to_dtype(type, &in.dtype)) {
    if (const char* known = ggml_type_name(type))
      fail_at(c.ctx(), what, ": ggml type ", known, " is not supported (tapegrad reads F32, BF16, F64 and I32)");
    fail_at(c.ctx(), what, ": unknown ggml type ", type);
  }
  if (numel > std::numeric_limits<std::uint64_t>::max() / itemsize(in.dtype))
    fail_at(c.ctx(), what, ": byte size of dims ", ne_text(ne), " overflows");
  in.nbytes = numel * itemsize(in.dtype);
  for (std::size_t d = ne.size(); d-- > 0;) in.shape.push_back(static_cast<std::int64_t>(ne[d]));
  in.offset = c.uint(8, what + "'s offset");
  return in;
}

// Offsets aligned, inside the data block of data_size bytes, and not overlapping.
void check_layout(std::vector<Info>& infos, std::uint64_t data_size, std::uint64_t align, const std::string& ctx) {
  for (const Info& in : infos) {
    if (in.offset % align != 0)
      fail_at(ctx, "tensor '", in.name, "': offset ", in.offset, " is not a multiple of the alignment ", align);
    if (in.offset > data_size || in.nbytes > data_size - in.offset)
      fail_at(ctx, "tensor '", in.name, "': bytes [", in.offset, ", ", in.offset, " + ", in.nbytes,
              ") lie outside the data block of ", data_size, " bytes (truncated file?)");
  }
  // ggml reads the data block as the tensors laid end to end, each padded to the alignment.
  std::uint64_t end = 0;
  for (const Info& in : infos) end = std::max(end, align_up(in.offset + in.nbytes, align));
  if (end > data_size)
    fail_at(ctx, "truncated: the data block holds ", data_size, " bytes but its last tensor's padding ends at ", end);
  std::vector<const Info*> order;
  for (const Info& in : infos) order.push_back(&in);
  std::sort(order.begin(), order.end(), [](const Info* a, const Info* b) { return a->offset < b->offset; });
  for (std::size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
      fail_at(ctx, "tensor '", order[i]->name, "' at offset ", order[i]->offset, " overlaps tensor '",
              order[i - 1]->name, "' at ", order[i - 1]->offset, " (", order[i - 1]->nbytes, " bytes)");
}

GGUFFile parse(const unsigned char* p, std::size_t n, const std::string& ctx) {
  Cursor c(p, n, ctx);
  if (n < 24) fail_at(ctx, "file is ", n, " bytes, shorter than the 24-byte GGUF header");
  if (std::memcmp(p, "GGUF", 4) != 0) fail_at(ctx, "not a GGUF file (the first 4 bytes are not \"GGUF\")");
  c.uint(4, "magic");
  const std::uint64_t version = c.uint(4, "version");
  if (version != kGGUFVersion) fail_at(ctx, "GGUF version ", version, " is not supported (tapegrad reads version 3)");
  const std::uint64_t n_tensors = c.uint(8, "tensor count"), n_kv = c.uint(8, "metadata count");
  // Each metadata entry takes at least 14 bytes (key length, a 1-byte key, type, a 1-byte value),
  // each tensor info at least 33 (name length, a 1-byte name, n_dims, one dim, type, offset).
  if (n_kv > c.left() / 14) fail_at(ctx, "metadata count ", n_kv, " cannot fit in the ", c.left(), " bytes that remain");
  if (n_tensors > c.left() / 33)
    fail_at(ctx, "tensor count ", n_tensors, " cannot fit in the ", c.left(), " bytes that remain");
  GGUFFile out;
  out.metadata = read_metadata(c, n_kv);
  const std::uint64_t align = alignment_of(out.metadata, ctx);
  std::vector<Info> infos;
  std::set<std::string> names;
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    infos.push_back(read_info(c, i));
    if (!names.insert(infos.back().name).second) fail_at(ctx, "duplicate tensor name '", infos.back().name, "'");
  }
  const std::uint64_t data_start = align_up(c.pos(), align);
  if (!infos.empty() && data_start > n)
    fail_at(ctx, "truncated: the data block starts at ", data_start, ", past the end of the file (", n, " bytes)");
  check_layout(infos, infos.empty() ? 0 : n - data_start, align, ctx);
  for (const Info& in : infos) {
    Tensor t = Tensor::empty(in.shape, in.dtype);
    if (in.nbytes) std::memcpy(t.raw_data(), p + data_start + in.offset, static_cast<std::size_t>(in.nbytes));
    out.tensors.insert(in.name, t);
  }
  return out;
}

}  // namespace

GGUFFile from_gguf_bytes(const std::string& bytes) {
  return parse(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), "load_gguf");
}

GGUFFile load_gguf(const std::string& path) {
  const std::string ctx = "load_gguf: '" + path + "'";
  FdGuard g;
  g.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (g.fd < 0) fail_at(ctx, "cannot open: ", errno_text(errno));
  struct stat st {};
  if (::fstat(g.fd, &st) != 0) fail_at(ctx, "cannot stat: ", errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail_at(ctx, "not a regular file");
  const auto n = static_cast<std::size_t>(st.st_size);
  if (n < 24) fail_at(ctx, "file is ", n, " bytes, shorter than the 24-byte GGUF header");
  void* map = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE, g.fd, 0);
  if (map == MAP_FAILED) fail_at(ctx, "cannot map: ", errno_text(errno));
  struct Unmap {
    void* p;
    std::size_t n;
    ~Unmap() { ::munmap(p, n); }
  } unmap{map, n};
  return parse(static_cast<const unsigned char*>(map), n, ctx);
}

}  // namespace tg
