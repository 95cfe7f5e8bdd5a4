// Checkpoint format: escaping of tensor and field names into path components.
#include "vfs/checkpoint.h"

#include <xxhash.h>

#include <fmt/format.h>

#include "vfs/internal/checkpoint_util.h"

namespace optstate::vfs {
namespace {

using internal::Hex16;

bool SafeByte(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

}  // namespace

std::string EscapeName(std::string_view name) {
  if (name.empty()) return "%";
  if (name == ".") return "%2E";
  if (name == "..") return "%2E%2E";
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(name.size());
  for (char ch : name) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (SafeByte(c)) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

Result<std::string> UnescapeName(std::string_view e) {
  if (e == "%") return std::string();
  auto hexval = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < e.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(e[i]);
    if (c == '%') {
      if (i + 2 >= e.size()) {
        return InvalidArgument(fmt::format("escaped name '{}': truncated %XX at byte {}", e, i));
      }
      int hi = hexval(e[i + 1]), lo = hexval(e[i + 2]);
      if (hi < 0 || lo < 0) {
        return InvalidArgument(fmt::format("escaped name '{}': bad %XX at byte {}", e, i));
      }
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (SafeByte(c)) {
      out.push_back(static_cast<char>(c));
    } else {
      return InvalidArgument(fmt::format("escaped name '{}': byte 0x{:02x} at {} must be escaped",
                                         e, c, i));
    }
  }
  if (EscapeName(out) != e) {
    return InvalidArgument(fmt::format("escaped name '{}' is not in canonical form", e));
  }
  return out;
}

std::string FileNameForName(std::string_view name) {
  std::string e = EscapeName(name);
  if (e.size() <= kMaxFileNameBytes) return e;
  size_t keep = kMaxFileNameBytes - 17;
  // Do not cut a %XX in half.
  while (keep > 0 && (e[keep - 1] == '%' || (keep >= 2 && e[keep - 2] == '%'))) --keep;
  return e.substr(0, keep) + "~" + Hex16(XXH3_64bits(name.data(), name.size()));
}

}  // namespace optstate::vfs
