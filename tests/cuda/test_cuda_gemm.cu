// Being written (issue #15).
#include <catch2/catch.hpp>
