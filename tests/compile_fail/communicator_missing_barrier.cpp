// Must NOT compile: check_communicator names the member the type lacks.
#include "shardlib/comm/communicator.hpp"
#include "shardlib/comm/work.hpp"

using namespace shardlib::comm;
struct no_barrier {
  int rank() const { return 0; }
  int size() const { return 1; }
  no_barrier split(int, int) { return {}; }
};
static_assert(check_communicator<no_barrier>());
int main() {}
