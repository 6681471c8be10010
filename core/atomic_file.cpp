// Files written whole or not at all: see atomic_file.h.
#include "atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "tapegrad/error.h"

namespace tg::detail {

namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

}  // namespace

std::string atomic_temp_name(const std::string& path) {
  static std::atomic<unsigned long> writes{0};
  std::string suffix = ".";  // appended piece by piece: GCC 12 warns (-Wrestrict) wrongly on "." + std::string
  suffix += std::to_string(::getpid()) + "." + std::to_string(writes.fetch_add(1)) + ".tmp";
  // The longest file name the directory takes (NAME_MAX, 255 bytes on most file systems; less on
  // some): a name near it would leave no room for the suffix, and the save would fail although
  // path itself is valid. The temporary name then keeps as much of the file name as fits, cut at
  // a UTF-8 character's start. (text/formats.cpp's temp_name does the same for the tokenizer's
  // save: the text library links no core, so a change here goes there too.)
  const std::size_t slash = path.rfind('/');
  const std::size_t start = slash == std::string::npos ? 0 : slash + 1;
  const std::string dir = start == 0 ? "." : start == 1 ? "/" : path.substr(0, start - 1);
  const long most = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const std::size_t limit = most > 0 ? static_cast<std::size_t>(most) : 255;
  std::size_t keep = path.size() - start;
  if (keep + suffix.size() > limit) {
    keep = limit > suffix.size() ? limit - suffix.size() : 1;
    while (keep > 1 && (static_cast<unsigned char>(path[start + keep]) & 0xC0) == 0x80) --keep;
  }
  return path.substr(0, start + keep) + suffix;
}

void write_all(int fd, const char* p, std::size_t n, const std::string& ctx) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<std::size_t>(n, std::size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail(ctx.c_str(), "write failed: ", w < 0 ? errno_text(errno) : "no progress");
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void write_atomically(const std::string& path, const std::string& ctx, const std::function<void(int fd)>& body) {
  // A name taken (a file a killed process of the same pid left, or another writer's whose long
  // name was cut to the same start) moves on to the next count.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 1000; ++attempt) {
    tmp = atomic_temp_name(path);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) fail(ctx.c_str(), "cannot create '", tmp, "': ", errno_text(errno));
  try {
    // A file replaced keeps its permission bits (a private 0600 file stays private).
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::fchmod(fd, st.st_mode & 07777) != 0)
      fail(ctx.c_str(), "cannot give '", tmp, "' the mode of the file it replaces: ", errno_text(errno));
    body(fd);
    if (::fsync(fd) != 0) fail(ctx.c_str(), "fsync of '", tmp, "' failed: ", errno_text(errno));
    const int f = fd;
    fd = -1;
    if (::close(f) != 0) fail(ctx.c_str(), "close of '", tmp, "' failed: ", errno_text(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(ctx.c_str(), "rename of '", tmp, "' to '", path, "' failed: ", errno_text(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int d = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d >= 0) {
    ::fsync(d);
    ::close(d);
  }
}

}  // namespace tg::detail
