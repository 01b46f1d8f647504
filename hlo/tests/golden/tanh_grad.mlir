module @tanh_grad attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<4x3xf32>, %W: tensor<3x2xf32>) -> (tensor<f32> {xtrain.name = "f"}, tensor<3x2xf32> {xtrain.name = "dW"}) {
    %0 = stablehlo.dot_general %x, %W, contracting_dims = [1] x [0] : (tensor<4x3xf32>, tensor<3x2xf32>) -> tensor<4x2xf32> loc("layer")
    %1 = stablehlo.tanh %0 : tensor<4x2xf32>
    %2 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %3 = stablehlo.reduce(%1 init: %2) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x2xf32>, tensor<f32>) -> tensor<f32>
    %4 = stablehlo.constant dense<1.0e0> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [] : (tensor<f32>) -> tensor<4x2xf32> loc("grad")
    %6 = stablehlo.multiply %1, %1 : tensor<4x2xf32> loc("grad")
    %7 = stablehlo.constant dense<1.0e0> : tensor<4x2xf32> loc("grad")
    %8 = stablehlo.subtract %7, %6 : tensor<4x2xf32> loc("grad")
    %9 = stablehlo.multiply %5, %8 : tensor<4x2xf32> loc("grad")
    %10 = stablehlo.dot_general %x, %9, contracting_dims = [0] x [0] : (tensor<4x3xf32>, tensor<4x2xf32>) -> tensor<3x2xf32> loc("layer.grad")
    return %3, %10 : tensor<f32>, tensor<3x2xf32>
  }
}
