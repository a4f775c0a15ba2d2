// TensorFlow op definitions (shapes and attributes only; kernels are in
// kernels.cc). reduce_op values follow tfmpi::ReduceOp.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {

using shape_inference::InferenceContext;

#define TFMPI_REDUCE_TYPES "{uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double}"
#define TFMPI_ALL_TYPES "{uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double, bool}"

namespace {
Status SameShapes(InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

Status UnknownFirstDim(InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) {
    shape_inference::ShapeHandle out;
    TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(i), 0, c->UnknownDim(), &out));
    c->set_output(i, out);
  }
  return absl::OkStatus();
}
}  // namespace

// The attributes every reducing collective shares (ReduceOp, the scale
// factors fused into the reduction, the name ranks negotiate by, the process
// set it runs in: engine.h). Every collective has the last two.
#define TFMPI_REDUCTION_ATTRS                   \
  .Attr("reduce_op: int")                       \
      .Attr("prescale_factor: float = 1.0")     \
      .Attr("postscale_factor: float = 1.0")    \
      .Attr("tensor_name: string = ''")        \
      .Attr("process_set_id: int = 0")

REGISTER_OP("TfMpiAllreduce")
    .Attr("T: " TFMPI_REDUCE_TYPES)
    TFMPI_REDUCTION_ATTRS
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TfMpiGroupedAllreduce")
    .Attr("T: list(" TFMPI_REDUCE_TYPES ")")
    TFMPI_REDUCTION_ATTRS
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TfMpiAllgather")
    .Attr("T: list(" TFMPI_ALL_TYPES ")")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim);

REGISTER_OP("TfMpiBroadcast")
    .Attr("T: list(" TFMPI_ALL_TYPES ")")
    .Attr("root_rank: int")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TfMpiAlltoall")
    .Attr("T: " TFMPI_ALL_TYPES)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("splits: int64")  // empty: equal split
    .Output("output: T")
    .Output("received_splits: int64")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(0), 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });

REGISTER_OP("TfMpiReducescatter")
    .Attr("T: list(" TFMPI_REDUCE_TYPES ")")
    TFMPI_REDUCTION_ATTRS
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim);

// Runtime queries as ops, so graphs can use them (values fixed at init()).
#define TFMPI_RUNTIME_OP(Name)  \
  REGISTER_OP(Name)             \
      .Output("value: int32")   \
      .SetIsStateful()          \
      .SetShapeFn(shape_inference::ScalarShape)

TFMPI_RUNTIME_OP("TfMpiRank");
TFMPI_RUNTIME_OP("TfMpiSize");
TFMPI_RUNTIME_OP("TfMpiLocalRank");
TFMPI_RUNTIME_OP("TfMpiLocalSize");

}  // namespace tensorflow
