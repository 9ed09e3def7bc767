// How every shim function reports a C++ exception to Rust: the message's first line, NUL-terminated, in the caller's
// buffer (libtorch appends a C++ backtrace after the first line). Every entry point runs its body through `guard`,
// which catches std::exception and then anything else: nothing may unwind across the FFI boundary into Rust.
#pragma once
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>

inline void write_error(const char* what, char* err, size_t len) {
  if (err == nullptr || len == 0) return;
  std::string msg = what;
  auto nl = msg.find('\n');
  if (nl != std::string::npos) msg.resize(nl);
  std::strncpy(err, msg.c_str(), len - 1);
  err[len - 1] = '\0';
}

inline void write_error(const std::exception& e, char* err, size_t len) { write_error(e.what(), err, len); }

// Runs `body` and returns what it returns; on any exception writes the message and returns `failed`.
template <typename F>
std::invoke_result_t<F&> guard(std::invoke_result_t<F&> failed, char* err, size_t len, F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    write_error(e, err, len);
  } catch (...) {
    write_error("an unknown C++ exception", err, len);
  }
  return failed;
}
