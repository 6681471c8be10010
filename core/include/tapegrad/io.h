#pragma once
// State dicts and the safetensors file format.
//
// safetensors (https://github.com/huggingface/safetensors): an 8-byte little-endian unsigned
// header length N, then N bytes of JSON mapping each tensor name to {"dtype", "shape",
// "data_offsets": [begin, end]} (byte offsets into the data block that follows the header, which
// the tensors cover contiguously with no gap or overlap), plus an optional "__metadata__" object
// of string to string. tapegrad writes and reads F32, F64, I32 and BF16 (bfloat16's bits as stored).
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tapegrad/tensor.h"

namespace tg {

// Named tensors in insertion order (like PyTorch's OrderedDict state_dict).
class StateDict {
 public:
  using Item = std::pair<std::string, Tensor>;
  // Adds or replaces an entry.
  void insert(const std::string& name, const Tensor& t);
  const Tensor* find(const std::string& name) const;  // null when absent
  // The entry; throws tg::Error naming the key when absent.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::map<std::string, std::size_t> index_;
};

using Metadata = std::map<std::string, std::string>;

// Writes atomically: to a temporary file of its own beside path ("<path>.<pid>.<n>.tmp", the file
// name cut where that would pass the directory's longest name), fsync'ed, then renamed over path,
// and the directory fsync'ed. A crash never leaves a half-written file under the final name (a
// process killed mid-write leaves its temporary file), a failure leaves path as it was, and two
// saves of one path at once each rename a whole file (the last one wins).
// The file is a new one (PyTorch's torch.save writes into an existing file): it takes the
// permission bits of the regular file it replaces, else 0644 less the umask; a symbolic link at
// path is replaced, not followed, and a hard link's other names keep the old file. Throws
// tg::Error on any I/O failure, naming the path.
void save_safetensors(const std::string& path, const StateDict& tensors, const Metadata& metadata = {});
// Same bytes, in memory.
std::string to_safetensors_bytes(const StateDict& tensors, const Metadata& metadata = {});

// Any bytes to path, written as save_safetensors writes its file: whole or not at all.
void write_file_atomic(const std::string& path, const std::string& bytes);

// Reads and validates every field before allocating: header length within the limit and the
// file, JSON well formed, known dtypes, non-negative shapes whose byte count matches the offsets
// without overflow, offsets inside the data block, sorted, non-overlapping and gap-free.
// A bad file is a tg::Error that says what is wrong, never a crash.
StateDict load_safetensors(const std::string& path, Metadata* metadata = nullptr);
StateDict from_safetensors_bytes(const std::string& bytes, Metadata* metadata = nullptr);

// Largest header accepted (the reference implementation's limit is 100 MB as well).
inline constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;

}  // namespace tg
