module @donate attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%param: tensor<2xf32> {tf.aliasing_output = 0 : i32}) -> (tensor<2xf32> {xtrain.name = "updated"}) {
    %0 = stablehlo.constant dense<[5.0e-1, 0x7FC00000]> : tensor<2xf32>
    %1 = stablehlo.compare EQ, %param, %param, FLOAT : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xi1>
    %2 = "stablehlo.select"(%1, %param, %0) : (tensor<2xi1>, tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    %3 = stablehlo.add %2, %0 : tensor<2xf32>
    return %3 : tensor<2xf32>
  }
}
