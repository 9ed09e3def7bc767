// How every shim function reports a C++ exception to Rust: the message's first line, NUL-terminated, in the caller's
// buffer (libtorch appends a C++ backtrace after the first line).
#pragma once
#include <cstring>
#include <exception>
#include <string>

inline void write_error(const std::exception& e, char* err, size_t len) {
  if (err == nullptr || len == 0) return;
  std::string msg = e.what();
  auto nl = msg.find('\n');
  if (nl != std::string::npos) msg.resize(nl);
  std::strncpy(err, msg.c_str(), len - 1);
  err[len - 1] = '\0';
}
