module @block_grad attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<4x2xf32>) -> (tensor<f32> {xtrain.name = "f"}, tensor<4x2xf32> {xtrain.name = "dx"}) {
    %0 = "stablehlo.slice"(%x) <{limit_indices = array<i64: 1, 2>, start_indices = array<i64: 0, 0>, strides = array<i64: 1, 1>}> : (tensor<4x2xf32>) -> tensor<1x2xf32>
    %1 = "stablehlo.slice"(%x) <{limit_indices = array<i64: 4, 2>, start_indices = array<i64: 1, 0>, strides = array<i64: 1, 1>}> : (tensor<4x2xf32>) -> tensor<3x2xf32>
    %2 = stablehlo.tanh %0 : tensor<1x2xf32>
    %3 = stablehlo.tanh %1 : tensor<3x2xf32>
    %4 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %5 = stablehlo.reduce(%2 init: %4) applies stablehlo.add across dimensions = [0, 1] : (tensor<1x2xf32>, tensor<f32>) -> tensor<f32>
    %6 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %7 = stablehlo.reduce(%3 init: %6) applies stablehlo.add across dimensions = [0, 1] : (tensor<3x2xf32>, tensor<f32>) -> tensor<f32>
    %8 = stablehlo.add %5, %7 : tensor<f32>
    %9 = stablehlo.constant dense<1.0e0> : tensor<f32>
    %10 = stablehlo.broadcast_in_dim %9, dims = [] : (tensor<f32>) -> tensor<3x2xf32> loc("grad")
    %11 = stablehlo.broadcast_in_dim %9, dims = [] : (tensor<f32>) -> tensor<1x2xf32> loc("grad")
    %12 = stablehlo.multiply %3, %3 : tensor<3x2xf32> loc("grad")
    %13 = stablehlo.constant dense<1.0e0> : tensor<3x2xf32> loc("grad")
    %14 = stablehlo.subtract %13, %12 : tensor<3x2xf32> loc("grad")
    %15 = stablehlo.multiply %10, %14 : tensor<3x2xf32> loc("grad")
    %16 = stablehlo.multiply %2, %2 : tensor<1x2xf32> loc("grad")
    %17 = stablehlo.constant dense<1.0e0> : tensor<1x2xf32> loc("grad")
    %18 = stablehlo.subtract %17, %16 : tensor<1x2xf32> loc("grad")
    %19 = stablehlo.multiply %11, %18 : tensor<1x2xf32> loc("grad")
    %20 = "stablehlo.concatenate"(%19, %15) <{dimension = 0 : i64}> : (tensor<1x2xf32>, tensor<3x2xf32>) -> tensor<4x2xf32>
    return %8, %20 : tensor<f32>, tensor<4x2xf32>
  }
}
