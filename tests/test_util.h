// tests/test_util.h -- helpers shared by the test files.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dsl/error.h"

/// Expects `statement` to throw mt::Error whose message contains every given fragment.
#define EXPECT_MT_ERROR(statement, ...)                                         \
  do {                                                                          \
    try {                                                                       \
      statement;                                                                \
      ADD_FAILURE() << "no mt::Error from " #statement;                         \
    } catch (const ::mixtape::Error& error) {                                   \
      for (const std::string& fragment : std::vector<std::string>{__VA_ARGS__}) \
        EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)  \
            << "missing \"" << fragment << "\" in: " << error.what();           \
    }                                                                           \
  } while (0)
