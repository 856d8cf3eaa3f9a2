/* The build's identity (cmake/version.cmake writes the definitions at build time). */
#ifndef DP_VERSION_H
#define DP_VERSION_H

extern const char dp_version[]; /* "0.1.0": the project version in CMakeLists.txt */
extern const char dp_commit[];  /* short git commit, "-dirty" suffix, or "unknown" */

#endif
