// GoogleTest assertions on Status and Result<T>, shared by the test folders
// (tests/common/test_util.h stays free of GoogleTest: child binaries use it).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <utility>

#include "base/status.h"

// Fails the test (and returns) when a Status is not OK, naming the
// expression and the status's message.
#define ASSERT_OK(expr)                                      \
  do {                                                       \
    const auto& s_ = (expr);                                 \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)

namespace optstate::test_util {

// The value of r; a failed Result fails the test and aborts it (the callers
// need the value to go on). `what`: the expression, for the message.
template <typename T>
T Unwrap(Result<T> r, const char* what = "") {
  if (!r.ok()) {
    ADD_FAILURE() << what << (*what != '\0' ? ": " : "") << r.status().ToString();
    std::abort();
  }
  return std::move(r).value();
}

}  // namespace optstate::test_util

// Unwrap(expr), naming the expression if it fails.
#define MUST(expr) ::optstate::test_util::Unwrap((expr), #expr)
