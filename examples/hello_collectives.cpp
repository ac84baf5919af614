// hello_collectives — the smallest shardlib program: four ranks as threads, a
// parameter tensor sharded across them, gathered, and its gradient averaged back.
#include <shardlib/shardlib.hpp>

#include <cstdio>
#include <vector>

using namespace shardlib;

int main() {
  comm::launch(4, [](comm::ThreadComm& c) {
    // 10 parameters over 4 ranks: shards of 3, the last two padded.
    shard::ShardedTensor<float> weights(10, c, category::parameters);
    std::vector<float> init{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    weights.assign_local(init);

    std::vector<float> full(weights.layout().padded_size());
    weights.gather(c, std::span<float>(full));  // every rank now holds all 10 (+2 padding)

    // Each rank's "gradient" is its rank everywhere; reduce_scatter averages it
    // and leaves each rank only its own shard: (0 + 1 + 2 + 3) / 4 = 1.5.
    std::vector<float> grad(full.size(), float(c.rank())), grad_shard(weights.layout().shard_size());
    c.reduce_scatter(std::span<const float>(grad), std::span<float>(grad_shard), comm::reduce_op::avg);

    std::printf("rank %d: gathered w[9] = %.0f, my shard holds global [%zu, %zu), grad %.2f\n", c.rank(), full[9],
                weights.layout().begin(c.rank()), weights.layout().end(c.rank()), grad_shard[0]);
  });
}
