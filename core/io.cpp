// State dicts and the safetensors format (https://github.com/huggingface/safetensors).
//
// Layout: u64 little-endian header length N, N bytes of UTF-8 JSON, then the data block. The
// writer follows the reference implementation: tensors sorted by dtype (F64, F32, I32, then BF16:
// the reference's dtype order descending) and then by name, packed without gaps; the
// header lists "__metadata__" first and then the tensors in data order, and is padded with spaces
// so that 8 + N is a multiple of 8. The reader validates the whole header against the file size
// before it allocates anything for tensor data.
#include "tapegrad/io.h"

#include <fcntl.h>
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

#include <nlohmann/json.hpp>

#include "atomic_file.h"

namespace tg {

// ---------------------------------------------------------------------------------------------
// StateDict

void StateDict::insert(const std::string& name, const Tensor& t) {
  auto it = index_.find(name);
  if (it != index_.end()) {
    items_[it->second].second = t;
    return;
  }
  index_.emplace(name, items_.size());
  items_.emplace_back(name, t);
}

const Tensor* StateDict::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

const Tensor& StateDict::at(const std::string& name) const {
  const Tensor* t = find(name);
  if (!t) fail("state_dict", "no key '", name, "'");
  return *t;
}

namespace {

static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "safetensors I/O needs a little- or big-endian platform");
constexpr bool kLittle = std::endian::native == std::endian::little;

constexpr std::size_t kHeaderLenBytes = 8;
constexpr const char* kMetadataKey = "__metadata__";
constexpr int kMaxJsonDepth = 32;

// Throws tg::Error("<ctx>: <parts...>"); ctx is the op name, possibly followed by a path.
template <class... Parts>
[[noreturn]] void fail_ctx(const std::string& ctx, const Parts&... parts) {
  std::ostringstream s;
  s << ctx << ": ";
  (s << ... << parts);
  throw Error(s.str());
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

const char* st_dtype_name(DType d) {
  switch (d) {
    case float32: return "F32";
    case float64: return "F64";
    case int32: return "I32";
    case bfloat16: return "BF16";
  }
  return "?";
}

// Position in the data block: the reference's dtype order, which sorts descending by its Dtype
// enum (... BF16 < I32 < F32 < F64).
int layout_rank(DType d) {
  switch (d) {
    case float64: return 0;
    case float32: return 1;
    case int32: return 2;
    case bfloat16: return 3;
  }
  return 4;
}

// Copies n elements of size itemsize from src to dst, converting between native and
// little-endian byte order (the same operation both ways).
void copy_le(void* dst, const void* src, std::size_t nbytes, std::size_t item) {
  if constexpr (kLittle) {
    if (nbytes) std::memcpy(dst, src, nbytes);
  } else {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    for (std::size_t off = 0; off < nbytes; off += item)
      for (std::size_t b = 0; b < item; ++b) d[off + b] = s[off + item - 1 - b];
  }
}

std::string shape_text(const std::vector<std::uint64_t>& dims) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << ']';
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// Writing

struct Layout {
  std::string header;                // 8-byte length prefix + padded JSON
  std::vector<const Tensor*> order;  // tensors in data-block order
};

Layout make_layout(const StateDict& tensors, const Metadata& metadata, const std::string& ctx) {
  std::vector<const StateDict::Item*> items;
  items.reserve(tensors.size());
  for (const auto& item : tensors) {
    if (item.first.empty()) fail_ctx(ctx, "tensor name is empty");
    if (item.first == kMetadataKey) fail_ctx(ctx, "tensor name '", kMetadataKey, "' is reserved for metadata");
    if (!item.second.defined()) fail_ctx(ctx, "tensor '", item.first, "' is undefined");
    items.push_back(&item);
  }
  std::sort(items.begin(), items.end(), [](const StateDict::Item* a, const StateDict::Item* b) {
    const int ra = layout_rank(a->second.dtype()), rb = layout_rank(b->second.dtype());
    if (ra != rb) return ra < rb;
    return a->first < b->first;
  });

  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j[kMetadataKey] = std::move(m);
  }
  Layout out;
  std::uint64_t offset = 0;
  for (const StateDict::Item* item : items) {
    const Tensor& t = item->second;
    const std::uint64_t nbytes = t.nbytes();
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = st_dtype_name(t.dtype());
    nlohmann::ordered_json shape = nlohmann::ordered_json::array();
    for (std::int64_t d : t.shape()) shape.push_back(static_cast<std::uint64_t>(d));
    e["shape"] = std::move(shape);
    e["data_offsets"] = {offset, offset + nbytes};
    j[item->first] = std::move(e);
    offset += nbytes;
    out.order.push_back(&t);
  }

  std::string json;
  try {
    json = j.dump();
  } catch (const nlohmann::json::exception& ex) {
    fail_ctx(ctx, "cannot encode the header (names and metadata must be valid UTF-8): ", ex.what());
  }
  json.append((8 - json.size() % 8) % 8, ' ');
  const std::uint64_t n = json.size();
  out.header.resize(kHeaderLenBytes);
  for (std::size_t b = 0; b < kHeaderLenBytes; ++b) out.header[b] = static_cast<char>((n >> (8 * b)) & 0xff);
  out.header += json;
  return out;
}

// Calls sink(ptr, nbytes) with the data block of each tensor in little-endian byte order.
template <class Sink>
void emit_data(const Layout& layout, Sink&& sink) {
  for (const Tensor* t : layout.order) {
    const std::size_t nbytes = t->nbytes();
    if (nbytes == 0) continue;
    if constexpr (kLittle) {
      sink(static_cast<const char*>(t->raw_data()), nbytes);
    } else {
      const std::size_t item = itemsize(t->dtype());
      constexpr std::size_t kChunk = 1 << 16;
      std::vector<char> buf(std::min(nbytes, kChunk));
      const char* src = static_cast<const char*>(t->raw_data());
      for (std::size_t off = 0; off < nbytes; off += kChunk) {
        const std::size_t len = std::min(kChunk, nbytes - off);
        copy_le(buf.data(), src + off, len, item);
        sink(buf.data(), len);
      }
    }
  }
}

// Closes fd on scope exit unless released.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// ---------------------------------------------------------------------------------------------
// Reading

struct Entry {
  std::string name;
  DType dtype = float32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;
};

struct Parsed {
  std::vector<Entry> entries;  // sorted by data offset
  Metadata metadata;
};

const char* json_type(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return "a non-negative integer";
  if (v.is_number_integer()) return "a negative integer";
  if (v.is_number_float()) return "a non-integer number";
  return v.type_name();
}

// The JSON text of v, shortened for an error message.
std::string brief(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// A non-negative JSON integer that fits u64 (larger integers parse as floats and are refused).
bool as_u64(const nlohmann::json& v, std::uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<std::uint64_t>();
  return true;
}

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "F32") *out = float32;
  else if (s == "F64") *out = float64;
  else if (s == "I32") *out = int32;
  else if (s == "BF16") *out = bfloat16;
  else return false;
  return true;
}

bool is_known_safetensors_dtype(const std::string& s) {
  static const char* const kKnown[] = {"BOOL",    "U8",      "I8",      "I16",      "U16",     "F16",
                                       "BF16",    "U32",     "I64",     "U64",      "C64",     "F8_E5M2",
                                       "F8_E4M3", "F8_E8M0", "F4",      "F6_E2M3",  "F6_E3M2"};
  for (const char* k : kKnown)
    if (s == k) return true;
  return false;
}

nlohmann::json parse_json(const char* p, std::size_t n, const std::string& ctx) {
  // A stack of the keys seen in each open object, to refuse duplicate keys (nlohmann would keep
  // the last one silently), and a cap on nesting.
  std::vector<std::set<std::string>> keys;
  auto cb = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) -> bool {
    using E = nlohmann::json::parse_event_t;
    if ((ev == E::object_start || ev == E::array_start) && depth >= kMaxJsonDepth)
      fail_ctx(ctx, "header JSON is nested more than ", kMaxJsonDepth, " levels deep");
    if (ev == E::object_start) {
      keys.emplace_back();
    } else if (ev == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (ev == E::key && !keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) fail_ctx(ctx, "header has duplicate key '", k, "'");
    }
    return true;
  };
  try {
    return nlohmann::json::parse(p, p + n, cb);
  } catch (const nlohmann::json::exception& ex) {
    fail_ctx(ctx, "header is not valid JSON: ", ex.what());
  }
}

std::vector<std::uint64_t> dims_of(const Shape& s) {
  std::vector<std::uint64_t> d;
  for (int i = 0; i < s.ndim(); ++i) d.push_back(static_cast<std::uint64_t>(s[i]));
  return d;
}

// An entry's shape into e.shape; returns its byte size at e.dtype, refusing overflow: every partial
// element count must also fit int64 (tg::Shape's element type).
std::uint64_t parse_shape(const std::string& name, const nlohmann::json& sh, Entry& e, const std::string& ctx) {
  if (!sh.is_array()) fail_ctx(ctx, "tensor '", name, "': shape is ", json_type(sh), ", not an array");
  if (sh.size() > static_cast<std::size_t>(Shape::kMaxDims))
    fail_ctx(ctx, "tensor '", name, "': shape has ", sh.size(), " dims, at most ", Shape::kMaxDims, " are supported");
  std::vector<std::uint64_t> dims;
  for (const auto& d : sh) {
    std::uint64_t x = 0;
    if (!as_u64(d, &x))
      fail_ctx(ctx, "tensor '", name, "': shape entries must be non-negative integers, got ", json_type(d), " in ",
               brief(sh));
    dims.push_back(x);
  }
  constexpr std::uint64_t kI64Max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t numel = 1;
  for (std::uint64_t d : dims) {
    if (d != 0 && numel > kI64Max / d)
      fail_ctx(ctx, "tensor '", name, "': shape ", shape_text(dims), " has too many elements (overflow)");
    numel *= d;
  }
  const std::uint64_t item = itemsize(e.dtype);
  if (numel > std::numeric_limits<std::uint64_t>::max() / item)
    fail_ctx(ctx, "tensor '", name, "': byte size of shape ", shape_text(dims), " overflows");
  for (std::uint64_t d : dims) e.shape.push_back(static_cast<std::int64_t>(d));
  return numel * item;
}

Entry parse_entry(const std::string& name, const nlohmann::json& v, std::uint64_t data_size, const std::string& ctx) {
  if (!v.is_object()) fail_ctx(ctx, "tensor '", name, "': entry is ", json_type(v), ", not an object");
  for (const auto& [k, unused] : v.items()) {
    (void)unused;
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      fail_ctx(ctx, "tensor '", name, "': unknown key '", k, "'");
  }
  for (const char* k : {"dtype", "shape", "data_offsets"})
    if (!v.contains(k)) fail_ctx(ctx, "tensor '", name, "': missing \"", k, "\"");

  Entry e;
  e.name = name;
  const nlohmann::json& dt = v["dtype"];
  if (!dt.is_string()) fail_ctx(ctx, "tensor '", name, "': dtype is ", json_type(dt), ", not a string");
  const std::string& ds = dt.get_ref<const std::string&>();
  if (!parse_dtype(ds, &e.dtype)) {
    if (is_known_safetensors_dtype(ds))
      fail_ctx(ctx, "tensor '", name, "': dtype ", ds, " is not supported (tapegrad reads F32, F64, I32 and BF16)");
    fail_ctx(ctx, "tensor '", name, "': unknown dtype '", ds, "'");
  }

  const std::uint64_t nbytes = parse_shape(name, v["shape"], e, ctx);
  const nlohmann::json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !as_u64(off[0], &e.begin) || !as_u64(off[1], &e.end))
    fail_ctx(ctx, "tensor '", name, "': data_offsets must be two non-negative integers, got ", brief(off));
  if (e.begin > e.end)
    fail_ctx(ctx, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] end before they begin");
  if (e.end - e.begin != nbytes)
    fail_ctx(ctx, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin,
             " bytes but dtype ", ds, " and shape ", shape_text(dims_of(e.shape)), " need ", nbytes);
  if (e.end > data_size)
    fail_ctx(ctx, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] lie outside the data block of ",
             data_size, " bytes");
  return e;
}

// Validates the JSON header (the bytes after the length prefix) against the data block size.
Parsed parse_header(const char* p, std::size_t n, std::uint64_t data_size, const std::string& ctx) {
  const nlohmann::json j = parse_json(p, n, ctx);
  if (!j.is_object()) fail_ctx(ctx, "header is ", json_type(j), ", not a JSON object");
  Parsed out;
  for (const auto& [key, v] : j.items()) {
    if (key == kMetadataKey) {
      if (!v.is_object()) fail_ctx(ctx, "__metadata__ is ", json_type(v), ", not an object of strings");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string())
          fail_ctx(ctx, "__metadata__ value of '", mk, "' is ", json_type(mv), ", not a string");
        out.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    out.entries.push_back(parse_entry(key, v, data_size, ctx));
  }
  // The reference's rule: sorted by offset, the tensors tile [0, data_size) exactly. Ties (empty
  // tensors at one offset) are broken the way the writer lays them out.
  std::sort(out.entries.begin(), out.entries.end(), [](const Entry& a, const Entry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    const int ra = layout_rank(a.dtype), rb = layout_rank(b.dtype);
    if (ra != rb) return ra < rb;
    return a.name < b.name;
  });
  std::uint64_t pos = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : out.entries) {
    if (e.begin < pos)
      fail_ctx(ctx, "tensor '", e.name, "' data_offsets [", e.begin, ", ", e.end, "] overlap tensor '", prev->name,
               "' [", prev->begin, ", ", prev->end, "]");
    if (e.begin > pos)
      fail_ctx(ctx, "gap in the data block: bytes [", pos, ", ", e.begin, ") before tensor '", e.name,
               "' belong to no tensor");
    pos = e.end;
    prev = &e;
  }
  if (pos != data_size)
    fail_ctx(ctx, "gap in the data block: the tensors cover ", pos, " of its ", data_size,
             " bytes (trailing bytes belong to no tensor)");
  return out;
}

std::uint64_t read_u64_le(const unsigned char* b) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return n;
}

// Checks the 8-byte prefix against the total size and returns the header length.
std::uint64_t check_prefix(const unsigned char* prefix, std::uint64_t total, const std::string& ctx) {
  const std::uint64_t n = read_u64_le(prefix);
  if (n > kMaxSafetensorsHeader)
    fail_ctx(ctx, "header length ", n, " exceeds the limit of ", kMaxSafetensorsHeader, " bytes");
  if (n > total - kHeaderLenBytes)
    fail_ctx(ctx, "header length ", n, " exceeds the ", total - kHeaderLenBytes, " bytes after the length prefix");
  return n;
}

void read_all(int fd, char* p, std::size_t n, const std::string& ctx) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, std::min<std::size_t>(n, std::size_t(1) << 30));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_ctx(ctx, "read failed: ", errno_text(errno));
    }
    if (r == 0) fail_ctx(ctx, "file ended early (truncated while reading?)");
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

std::string path_ctx(const char* op, const std::string& path) { return std::string(op) + ": '" + path + "'"; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

std::string to_safetensors_bytes(const StateDict& tensors, const Metadata& metadata) {
  const Layout layout = make_layout(tensors, metadata, "to_safetensors_bytes");
  std::size_t total = layout.header.size();
  for (const Tensor* t : layout.order) total += t->nbytes();
  std::string out;
  out.reserve(total);
  out += layout.header;
  emit_data(layout, [&](const char* p, std::size_t n) { out.append(p, n); });
  return out;
}

void save_safetensors(const std::string& path, const StateDict& tensors, const Metadata& metadata) {
  const std::string ctx = path_ctx("save_safetensors", path);
  const Layout layout = make_layout(tensors, metadata, ctx);
  detail::write_atomically(path, ctx, [&](int fd) {
    detail::write_all(fd, layout.header.data(), layout.header.size(), ctx);
    emit_data(layout, [&](const char* p, std::size_t n) { detail::write_all(fd, p, n, ctx); });
  });
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  const std::string ctx = path_ctx("write_file_atomic", path);
  detail::write_atomically(path, ctx, [&](int fd) { detail::write_all(fd, bytes.data(), bytes.size(), ctx); });
}

StateDict from_safetensors_bytes(const std::string& bytes, Metadata* metadata) {
  const std::string ctx = "load_safetensors";
  if (bytes.size() < kHeaderLenBytes)
    fail_ctx(ctx, "input is ", bytes.size(), " bytes, shorter than the 8-byte header length");
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::uint64_t n = check_prefix(u, bytes.size(), ctx);
  const std::uint64_t data_start = kHeaderLenBytes + n;
  Parsed parsed = parse_header(bytes.data() + kHeaderLenBytes, static_cast<std::size_t>(n),
                               bytes.size() - data_start, ctx);
  StateDict out;
  for (const Entry& e : parsed.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    copy_le(t.raw_data(), bytes.data() + data_start + e.begin, static_cast<std::size_t>(e.end - e.begin),
            itemsize(e.dtype));
    out.insert(e.name, t);
  }
  if (metadata) *metadata = std::move(parsed.metadata);
  return out;
}

StateDict load_safetensors(const std::string& path, Metadata* metadata) {
  const std::string ctx = path_ctx("load_safetensors", path);
  FdGuard g;
  g.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (g.fd < 0) fail_ctx(ctx, "cannot open: ", errno_text(errno));
  struct stat st {};
  if (::fstat(g.fd, &st) != 0) fail_ctx(ctx, "cannot stat: ", errno_text(errno));
  if (!S_ISREG(st.st_mode)) fail_ctx(ctx, "not a regular file");
  const std::uint64_t total = static_cast<std::uint64_t>(st.st_size);
  if (total < kHeaderLenBytes) fail_ctx(ctx, "file is ", total, " bytes, shorter than the 8-byte header length");
  unsigned char prefix[kHeaderLenBytes];
  read_all(g.fd, reinterpret_cast<char*>(prefix), kHeaderLenBytes, ctx);
  const std::uint64_t n = check_prefix(prefix, total, ctx);
  std::string header(static_cast<std::size_t>(n), '\0');
  read_all(g.fd, header.data(), header.size(), ctx);
  const std::uint64_t data_size = total - kHeaderLenBytes - n;
  Parsed parsed = parse_header(header.data(), header.size(), data_size, ctx);
  header = std::string();
  // The tensors tile the data block in order, so it is read sequentially.
  StateDict out;
  std::vector<char> swap;
  for (const Entry& e : parsed.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    const std::size_t nbytes = static_cast<std::size_t>(e.end - e.begin);
    read_all(g.fd, static_cast<char*>(t.raw_data()), nbytes, ctx);
    if constexpr (!kLittle) {
      swap.resize(nbytes);
      copy_le(swap.data(), t.raw_data(), nbytes, itemsize(e.dtype));
      if (nbytes) std::memcpy(t.raw_data(), swap.data(), nbytes);
    }
    out.insert(e.name, t);
  }
  if (metadata) *metadata = std::move(parsed.metadata);
  return out;
}

}  // namespace tg
