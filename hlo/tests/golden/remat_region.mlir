module @remat attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<2x4xf32>, %w: tensor<4x4xf32>) -> (tensor<f32> {xtrain.name = "loss"}, tensor<4x4xf32> {xtrain.name = "dw"}) {
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("block")
    %1 = stablehlo.logistic %0 : tensor<2x4xf32> loc("block")
    %2 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %3 = stablehlo.reduce(%1 init: %2) applies stablehlo.add across dimensions = [0, 1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<f32>
    %4 = stablehlo.constant dense<1.0e0> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [] : (tensor<f32>) -> tensor<2x4xf32> loc("grad")
    %6:3 = "stablehlo.optimization_barrier"(%x, %w, %5) : (tensor<2x4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) -> (tensor<2x4xf32>, tensor<4x4xf32>, tensor<2x4xf32>) loc("block.grad")
    %7 = stablehlo.dot_general %6#0, %6#1, contracting_dims = [1] x [0] : (tensor<2x4xf32>, tensor<4x4xf32>) -> tensor<2x4xf32> loc("block.grad")
    %8 = stablehlo.logistic %7 : tensor<2x4xf32> loc("block.grad")
    %9 = stablehlo.constant dense<1.0e0> : tensor<2x4xf32> loc("block.grad")
    %10 = stablehlo.subtract %9, %8 : tensor<2x4xf32> loc("block.grad")
    %11 = stablehlo.multiply %8, %10 : tensor<2x4xf32> loc("block.grad")
    %12 = stablehlo.multiply %5, %11 : tensor<2x4xf32> loc("block.grad")
    %13 = stablehlo.dot_general %6#0, %12, contracting_dims = [0] x [0] : (tensor<2x4xf32>, tensor<2x4xf32>) -> tensor<4x4xf32> loc("block.grad")
    return %3, %13 : tensor<f32>, tensor<4x4xf32>
  }
}
