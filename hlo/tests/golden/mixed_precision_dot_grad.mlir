module @mixed attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<4x3xbf16>, %W: tensor<2x3xbf16>) -> (tensor<f32> {xtrain.name = "f"}, tensor<4x3xbf16> {xtrain.name = "dx"}, tensor<2x3xbf16> {xtrain.name = "dW"}) {
    %0 = stablehlo.dot_general %x, %W, contracting_dims = [1] x [1] : (tensor<4x3xbf16>, tensor<2x3xbf16>) -> tensor<4x2xf32> loc("layer")
    %1 = stablehlo.tanh %0 : tensor<4x2xf32>
    %2 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %3 = stablehlo.reduce(%1 init: %2) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x2xf32>, tensor<f32>) -> tensor<f32>
    %4 = stablehlo.constant dense<1.0e0> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [] : (tensor<f32>) -> tensor<4x2xf32> loc("grad")
    %6 = stablehlo.multiply %1, %1 : tensor<4x2xf32> loc("grad")
    %7 = stablehlo.constant dense<1.0e0> : tensor<4x2xf32> loc("grad")
    %8 = stablehlo.subtract %7, %6 : tensor<4x2xf32> loc("grad")
    %9 = stablehlo.multiply %5, %8 : tensor<4x2xf32> loc("grad")
    %10 = stablehlo.convert %9 : (tensor<4x2xf32>) -> tensor<4x2xbf16> loc("layer.grad")
    %11 = stablehlo.dot_general %10, %W, contracting_dims = [1] x [0] : (tensor<4x2xbf16>, tensor<2x3xbf16>) -> tensor<4x3xf32> loc("layer.grad")
    %12 = stablehlo.convert %11 : (tensor<4x3xf32>) -> tensor<4x3xbf16> loc("layer.grad")
    %13 = stablehlo.dot_general %x, %10, contracting_dims = [0] x [0] : (tensor<4x3xbf16>, tensor<4x2xbf16>) -> tensor<3x2xf32> loc("layer.grad")
    %14 = stablehlo.convert %13 : (tensor<3x2xf32>) -> tensor<3x2xbf16> loc("layer.grad")
    %15 = stablehlo.transpose %14, dims = [1, 0] : (tensor<3x2xbf16>) -> tensor<2x3xbf16> loc("layer.grad")
    return %3, %12, %15 : tensor<f32>, tensor<4x3xbf16>, tensor<2x3xbf16>
  }
}
