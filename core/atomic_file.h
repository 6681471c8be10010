// Files written whole or not at all, for the savers (io.cpp, gguf.cpp): internal to the core.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace tg::detail {

// The temporary file a write of path goes through: "<path>.<pid>.<n>.tmp", n counting this
// process's writes, so that no two writes share one (two processes, or two threads, saving the
// same path each rename a whole file of their own; the last rename wins). Where the file name and
// the suffix would pass the directory's longest name, the file name is cut to make room.
std::string atomic_temp_name(const std::string& path);

// Writes path through atomic_temp_name(path): body(fd) writes the bytes, then the file is
// fsync'ed, closed, renamed over path, and path's directory fsync'ed (best effort: a directory
// that cannot be opened is skipped), so the rename survives a power cut. The file is created
// exclusively (O_EXCL; a name taken moves on to the next count), with mode 0644 less the umask,
// or the permission bits of the regular file it replaces. On any failure, body's tg::Error
// included, the temporary file is removed and path is left as it was; a process killed mid-write
// leaves it. Errors are tg::Error "<ctx>: ...".
void write_atomically(const std::string& path, const std::string& ctx, const std::function<void(int fd)>& body);

// All n bytes at p to fd, through EINTR and short writes; a tg::Error "<ctx>: write failed: ..."
// otherwise.
void write_all(int fd, const char* p, std::size_t n, const std::string& ctx);

}  // namespace tg::detail
