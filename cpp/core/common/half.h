// float16 / bfloat16 <-> float conversions with round-to-nearest-even.
// The engine reduces 16-bit floats through float so sums are as exact as the
// 16-bit result allows (MPI has no native half types).
#pragma once

#include <cstdint>
#include <cstring>

namespace tfmpi {

struct Float16 { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(BFloat16 h) { return BitsToFloat(static_cast<uint32_t>(h.bits) << 16); }

inline BFloat16 ToBFloat16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {static_cast<uint16_t>(u >> 16)};
}

inline float ToFloat(Float16 h) {
  uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // Subnormal half: value = man * 2^-24.
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}

inline Float16 ToFloat16(float f) {
  uint32_t u = FloatToBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in half: scale so the integer part is the mantissa.
    float a = BitsToFloat(abs) * 16777216.0f;  // exact in float for these magnitudes
    uint32_t m = static_cast<uint32_t>(a);
    float rem = a - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return {static_cast<uint16_t>(sign | m)};
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits, nearest even.
  uint32_t r = abs - 0x38000000u;  // exponent bias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return {static_cast<uint16_t>(sign | (r >> 13))};
}

}  // namespace tfmpi
