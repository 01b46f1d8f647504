module @custom_vjp attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%x: tensor<3xf32>) -> (tensor<f32> {xtrain.name = "f"}, tensor<3xf32> {xtrain.name = "dx"}) {
    %0 = stablehlo.constant dense<1.0e0> : tensor<3xf32>
    %1 = stablehlo.constant dense<0> : tensor<i32> loc("cube")
    %2:3 = "stablehlo.while"(%1, %0, %x) ({
    ^bb0(%3: tensor<i32>, %4: tensor<3xf32>, %5: tensor<3xf32>):
      %6 = stablehlo.constant dense<3> : tensor<i32>
      %7 = stablehlo.compare LT, %3, %6, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %7 : tensor<i1>
    }, {
    ^bb0(%8: tensor<i32>, %9: tensor<3xf32>, %10: tensor<3xf32>):
      %11 = stablehlo.multiply %9, %10 : tensor<3xf32> loc("cube")
      %12 = stablehlo.constant dense<1> : tensor<i32> loc("cube")
      %13 = stablehlo.add %8, %12 : tensor<i32> loc("cube")
      stablehlo.return %13, %11, %10 : tensor<i32>, tensor<3xf32>, tensor<3xf32>
    }) : (tensor<i32>, tensor<3xf32>, tensor<3xf32>) -> (tensor<i32>, tensor<3xf32>, tensor<3xf32>) loc("cube")
    %14 = stablehlo.constant dense<0.0e0> : tensor<f32>
    %15 = stablehlo.reduce(%2#1 init: %14) applies stablehlo.add across dimensions = [0] : (tensor<3xf32>, tensor<f32>) -> tensor<f32>
    %16 = stablehlo.constant dense<1.0e0> : tensor<f32>
    %17 = stablehlo.broadcast_in_dim %16, dims = [] : (tensor<f32>) -> tensor<3xf32> loc("grad")
    %18 = stablehlo.multiply %x, %x : tensor<3xf32> loc("grad")
    %19 = stablehlo.constant dense<3.0e0> : tensor<3xf32> loc("grad")
    %20 = stablehlo.multiply %18, %19 : tensor<3xf32> loc("grad")
    %21 = stablehlo.multiply %20, %17 : tensor<3xf32> loc("grad")
    return %15, %21 : tensor<f32>, tensor<3xf32>
  }
}
