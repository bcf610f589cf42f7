"""A TrainOneStepCell that also returns the global gradient norm (imports MindSpore)."""
from __future__ import annotations

from mindspore import nn, ops
from mindspore.ops import composite as C

_hyper_map = C.HyperMap()


def _square_sum(grad):  # type: ignore[no-untyped-def]  # graph mode: source kept plain
    return ops.reduce_sum(ops.square(grad.astype("float32")))


class TrainOneStepWithGradNorm(nn.TrainOneStepCell):  # type: ignore[misc]  # untyped base
    """`nn.TrainOneStepCell` returning `(loss, global_norm)`: the L2 norm of all gradients.

    The norm is taken after the data-parallel gradient reduction, so every rank reports the
    norm of the gradient the optimizer applies. Works on CPU (no loss-scale status ops).

        net = TrainOneStepWithGradNorm(WithLossCell(backbone, loss_fn), optimizer)
        Model(net).train(epochs, dataset, callbacks=[OTelMonitor(metrics=["loss", "grad_norm"])])
    """

    def construct(self, *inputs):  # type: ignore[no-untyped-def]  # graph-mode construct
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.grad_reducer(grads)
        global_norm = ops.sqrt(ops.addn(_hyper_map(_square_sum, grads)))
        loss = ops.depend(loss, self.optimizer(grads))
        return loss, global_norm
