// base/: the dtype table, moment dtypes, EditDistance and Status/Result,
// each checked against values written out by hand here.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "base/strings.h"

namespace optstate {
namespace {

struct DTypeCase {
  DType dtype;
  int value;  // stored on disk: must never change
  const char* name;
  const char* alias;
  const char* safetensors;
  uint32_t size_bytes;
};

constexpr DTypeCase kDTypeCases[] = {
    {DType::kF32, 0, "f32", "float32", "F32", 4},  {DType::kBF16, 1, "bf16", "bfloat16", "BF16", 2},
    {DType::kF16, 2, "f16", "float16", "F16", 2},  {DType::kQ8S, 3, "q8s", nullptr, "U8", 1},
    {DType::kQ8U, 4, "q8u", nullptr, "U8", 1},
};

TEST(DTypeTest, EveryRowRoundTripsThroughItsName) {
  for (const DTypeCase& c : kDTypeCases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(static_cast<int>(c.dtype), c.value);
    EXPECT_STREQ(DTypeName(c.dtype), c.name);
    EXPECT_STREQ(SafetensorsDTypeName(c.dtype), c.safetensors);
    EXPECT_EQ(DTypeSize(c.dtype), c.size_bytes);
    EXPECT_EQ(IsQ8(c.dtype), c.dtype == DType::kQ8S || c.dtype == DType::kQ8U);
    Result<DType> parsed = ParseDType(c.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, c.dtype);
    ASSERT_TRUE(ParseDTypeName(c.name).has_value());
    EXPECT_EQ(*ParseDTypeName(c.name), c.dtype);
  }
}

TEST(DTypeTest, AliasesParseOnlyWhereAliasesAreAccepted) {
  for (const DTypeCase& c : kDTypeCases) {
    if (c.alias == nullptr) continue;
    SCOPED_TRACE(c.alias);
    Result<DType> parsed = ParseDType(c.alias);
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, c.dtype);
    // The checkpoint manifest stores only the table's names.
    EXPECT_FALSE(ParseDTypeName(c.alias).has_value());
  }
}

TEST(DTypeTest, UnknownNamesAreRefusedNamingTheInput) {
  for (const char* bad : {"", "F32", "fp32", "q8", "int8", "f64", "bf16 ", "u8"}) {
    SCOPED_TRACE(bad);
    Result<DType> parsed = ParseDType(bad);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find("'" + std::string(bad) + "'"), std::string::npos)
        << parsed.status().message();
    EXPECT_FALSE(ParseDTypeName(bad).has_value());
  }
  EXPECT_STREQ(DTypeName(static_cast<DType>(200)), "?");
}

TEST(MomentDTypeTest, ParseNameAndFieldDType) {
  struct Case {
    const char* name;
    MomentDType moment;
    DType exp_avg;
    DType exp_avg_sq;
  };
  for (const Case& c : {Case{"f32", MomentDType::kF32, DType::kF32, DType::kF32},
                        Case{"bf16", MomentDType::kBF16, DType::kBF16, DType::kBF16},
                        Case{"q8", MomentDType::kQ8, DType::kQ8S, DType::kQ8U}}) {
    SCOPED_TRACE(c.name);
    Result<MomentDType> m = ParseMomentDType(c.name);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(*m, c.moment);
    EXPECT_STREQ(MomentDTypeName(c.moment), c.name);
    EXPECT_EQ(MomentFieldDType(c.moment, "exp_avg"), c.exp_avg);
    EXPECT_EQ(MomentFieldDType(c.moment, "exp_avg_sq"), c.exp_avg_sq);
  }
  for (const char* bad : {"f16", "q8s", "q8u", "float32", "", "Q8"}) {
    SCOPED_TRACE(bad);
    Result<MomentDType> m = ParseMomentDType(bad);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(m.status().message(), "moment dtype '" + std::string(bad) + "' is not supported (f32, bf16, q8)");
  }
}

TEST(EditDistanceTest, HandCheckedPairs) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("abc", "abc"), 0u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);  // k->s, e->i, +g
  EXPECT_EQ(EditDistance("sitting", "kitten"), 3u);
  EXPECT_EQ(EditDistance("flaw", "lawn"), 2u);        // -f, +n
  EXPECT_EQ(EditDistance("exp_avg", "exp_avg_sq"), 3u);
  EXPECT_EQ(EditDistance("ab", "ba"), 2u);            // no transpositions
  EXPECT_EQ(EditDistance("Main", "main"), 1u);        // case-sensitive
}

TEST(StatusTest, CodesMessagesAndContext) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.ToString(), "OK");
  EXPECT_EQ(ok.ToErrno(), 0);
  EXPECT_TRUE(ok.WithContext("ignored").ok());

  Status nf = NotFound("tensor 'w'");
  EXPECT_FALSE(nf.ok());
  EXPECT_TRUE(nf.IsNotFound());
  EXPECT_EQ(nf.ToString(), "NotFound: tensor 'w'");
  EXPECT_EQ(nf.ToErrno(), ENOENT);
  Status ctx = nf.WithContext("store /s");
  EXPECT_EQ(ctx.code(), StatusCode::kNotFound);
  EXPECT_EQ(ctx.message(), "store /s: tensor 'w'");
}

TEST(StatusTest, ErrnoStatusMapsAndKeepsTheErrno) {
  Status s = ErrnoStatus("pwrite /d/x", ENOSPC);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.err(), ENOSPC);
  EXPECT_EQ(s.ToErrno(), ENOSPC);
  EXPECT_EQ(s.message(), std::string("pwrite /d/x: ") + std::strerror(ENOSPC) + " (errno " +
                             std::to_string(ENOSPC) + ")");
  EXPECT_EQ(ErrnoStatus("x", EDQUOT).code(), StatusCode::kNoSpace);
  EXPECT_EQ(ErrnoStatus("x", ENOENT).code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoStatus("x", EEXIST).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(ErrnoStatus("x", EWOULDBLOCK).code(), StatusCode::kBusy);
  EXPECT_EQ(ErrnoStatus("x", EINVAL).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrnoStatus("x", EMFILE).code(), StatusCode::kResourceExhausted);
  Status io = ErrnoStatus("read", EIO);
  EXPECT_EQ(io.code(), StatusCode::kIoError);
  EXPECT_EQ(io.ToErrno(), EIO);
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  OPTSTATE_ASSIGN_OR_RETURN(int h, Half(x));
  OPTSTATE_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

Status CheckQuarter(int x) {
  OPTSTATE_RETURN_IF_ERROR(Quarter(x).status());
  return Status::Ok();
}

TEST(ResultTest, ValueOrStatusAndTheMacros) {
  Result<int> r = Quarter(12);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 3);
  Result<int> bad = Quarter(6);  // 6 -> 3, then 3 is odd
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "odd: 3");
  EXPECT_TRUE(CheckQuarter(8).ok());
  EXPECT_EQ(CheckQuarter(2).code(), StatusCode::kInvalidArgument);
  // A Result may not hold an OK Status: that is a bug of the caller.
  Result<int> from_ok{Status::Ok()};
  ASSERT_FALSE(from_ok.ok());
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace optstate
