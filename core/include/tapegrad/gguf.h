#pragma once
// The GGUF file format, version 3 (llama.cpp's model files: https://github.com/ggml-org/ggml,
// docs/gguf.md), beside safetensors (tapegrad/io.h).
//
// Layout, all little-endian:
//   "GGUF", u32 version 3, u64 tensor count, u64 metadata count;
//   metadata: key (u64 length + bytes), u32 value type, the value (a string is u64 length + bytes;
//             an array is u32 element type, u64 count, the elements);
//   tensor infos: name, u32 n_dims, u64 ne[n_dims] (ggml's order: ne[0] is the fastest-varying
//             dimension, so a row-major shape (out, in) is written ne = [in, out]), u32 ggml type,
//             u64 offset into the data block (a multiple of the alignment);
//   zero padding to the alignment ("general.alignment", 32 when absent), then the data block.
// tapegrad reads and writes F32, BF16 (ggml types 0 and 30), F64 and I32 (28 and 26); the
// quantised types are refused with their name.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tapegrad/io.h"

namespace tg {

// GGUF metadata value types, numbered as in the file.
enum class GGUFType : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12
};
const char* gguf_type_name(GGUFType t);  // "UINT32", "STRING", ...

// One metadata value: a scalar of any GGUF type, a string, or an array of scalars or strings
// (arrays of arrays are refused, as ggml does). Numbers are kept as their little-endian bytes, so
// an array costs what it takes in the file.
class GGUFValue {
 public:
  GGUFValue() = default;
  static GGUFValue of_u32(std::uint32_t v);
  static GGUFValue of_i32(std::int32_t v);
  static GGUFValue of_u64(std::uint64_t v);
  static GGUFValue of_f32(float v);
  static GGUFValue of_f64(double v);
  static GGUFValue of_bool(bool v);
  static GGUFValue of_string(std::string v);
  static GGUFValue strings(std::vector<std::string> v);
  static GGUFValue f32s(const std::vector<float>& v);
  static GGUFValue i32s(const std::vector<std::int32_t>& v);

  GGUFType type() const { return type_; }
  GGUFType element_type() const { return element_; }  // of an array
  std::size_t size() const;                           // an array's length; 1 for a scalar

  // Typed reads; each throws tg::Error naming `what` (the key) when the value has another type
  // or does not fit. as_uint takes any integer type holding a non-negative value, as_int any
  // integer type, as_double any integer or float type.
  std::uint64_t as_uint(const std::string& what) const;
  std::int64_t as_int(const std::string& what) const;
  double as_double(const std::string& what) const;
  bool as_bool(const std::string& what) const;
  const std::string& as_string(const std::string& what) const;
  const std::vector<std::string>& as_strings(const std::string& what) const;  // an array of strings
  // Element i of an array of numbers or booleans, as a scalar value.
  GGUFValue item(std::size_t i, const std::string& what) const;

 private:
  friend class GGUFCodec;  // the reader and writer (core/gguf.cpp)
  GGUFType type_ = GGUFType::u32, element_ = GGUFType::u8;
  std::string raw_ = std::string(4, '\0');  // a scalar's or a numeric array's little-endian bytes (UINT32 0)
  std::string str_;                   // a string
  std::vector<std::string> strings_;  // an array of strings
};

// Metadata in file order, keys unique.
class GGUFMetadata {
 public:
  using Item = std::pair<std::string, GGUFValue>;
  void set(const std::string& key, GGUFValue v);  // adds, or replaces in place
  const GGUFValue* find(const std::string& key) const;
  const GGUFValue& at(const std::string& key) const;  // throws tg::Error naming the key
  bool contains(const std::string& key) const { return find(key) != nullptr; }
  std::size_t size() const { return items_.size(); }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::map<std::string, std::size_t> index_;
};

// What a GGUF file holds. Tensor shapes are tapegrad's (row-major, outermost first): ggml's ne
// reversed.
struct GGUFFile {
  GGUFMetadata metadata;
  StateDict tensors;  // in file order
};

inline constexpr std::uint32_t kGGUFVersion = 3;
inline constexpr std::uint64_t kGGUFDefaultAlignment = 32;
inline constexpr std::size_t kGGUFMaxName = 63;  // ggml's GGML_MAX_NAME (64) less the terminating NUL
inline constexpr int kGGUFMaxDims = 4;           // ggml's GGML_MAX_DIMS
// The largest "general.alignment" read or written (64 KiB, the largest common page size; ggml sets
// no bound). The writer pads the header and every tensor to it, so an alignment taken from a file
// would otherwise size that padding: 2^31, UINT32's largest power of two, is 2 GiB per tensor.
inline constexpr std::uint64_t kGGUFMaxAlignment = std::uint64_t{1} << 16;

// Writes the tensors (F32, BF16, F64 or I32; 1 to 4 dims; names of 1 to 63 bytes) in the
// StateDict's order with the metadata, to a temporary file beside path that is fsync'ed and
// renamed over it, so a failure never leaves a file under path. "general.alignment" in the
// metadata (a UINT32 power of two, at most kGGUFMaxAlignment) sets the alignment, else 32. Throws
// tg::Error on bad input or I/O failure.
void save_gguf(const std::string& path, const StateDict& tensors, const GGUFMetadata& metadata);
std::string to_gguf_bytes(const StateDict& tensors, const GGUFMetadata& metadata);  // the same bytes

// Reads and validates every field before allocating for it: magic and version, counts that fit
// in the file, known value types, booleans 0 or 1, no duplicate keys or names, lengths inside the
// file, dims whose element and byte counts do not overflow, the alignment a power of two up to
// kGGUFMaxAlignment, offsets aligned, inside the data block and not overlapping. Every count,
// length and dim is held to the bytes that remain, so nothing read is allocated beyond what the
// file's size accounts for. A bad file is a tg::Error naming the field, never a crash.
GGUFFile load_gguf(const std::string& path);
GGUFFile from_gguf_bytes(const std::string& bytes);

}  // namespace tg
