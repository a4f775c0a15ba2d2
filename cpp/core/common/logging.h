// Rank-prefixed messages on stderr, so interleaved output from many ranks
// stays attributable.
#pragma once

#include <string>

namespace tfmpi {

void SetLogRank(int rank);
void LogInfo(const std::string& msg);
void LogWarning(const std::string& msg);
void LogError(const std::string& msg);

}  // namespace tfmpi
