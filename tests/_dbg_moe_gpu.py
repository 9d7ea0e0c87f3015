import torch,sys
sys.path.insert(0,"tests")
from tritonep.testing import run_gpu_world
from tritonep.moe import MoELayer,MoERecipe,MoEGeometry
import tritonep.moe.experts as ex
def f(group,A,kind,loop,ident,T):
    import torch.distributed as dist
    r=dist.get_rank(group)
    if loop: ex._GROUPED_REFUSED.add(("cuda",torch.bfloat16))
    geo=MoEGeometry(256,128,16,4,128)
    L=MoELayer(MoERecipe(expert_alignment=A,combine=kind),geo,group,seed=3)
    g=torch.Generator().manual_seed(r)
    x=torch.randn(T,256,generator=g).bfloat16().cuda()
    idx,w=L.router(x)
    d=L.buffer.dispatch(x,idx,w)
    if ident: eo=d.x.clone()
    else:
        out=L.buffer.expert_out_buffer(d.x.shape[0]); eo,_=ex.expert_ffn_forward(d.x,d.expert_offsets,L.w1,L.w2,out)
    y=L.buffer.combine(eo,d.handle,kind=kind)
    if ident:
        ref=(w[...,None]*x.float()[:,None]).sum(1)
    else:
        w1a,w2a=MoELayer.init_expert_weights(geo,3,torch.bfloat16)
        from tritonep.reference import moe_dense_reference
        ref=moe_dense_reference(x.float(),idx,w,w1a.float().cuda(),w2a.float().cuda())
    e=((y.float()-ref).abs().max()/ref.abs().max()).item()
    res=(e,d.x.shape[0],d.expert_offsets.tolist())
    L.close(); return res
for A,kind,loop,ident,T in [(1,"pull",0,1,128),(8,"pull",0,1,128),(1,"push",0,1,128),(1,"pull",0,0,128),(1,"pull",1,0,128),(8,"pull",1,0,128),(8,"push",0,0,128),(1,"pull",0,0,16)]:
    try: print(A,kind,loop,ident,T,run_gpu_world(2,f,A,kind,loop,ident,T),flush=True)
    except Exception as e: print(A,kind,loop,ident,T,"ERR",str(e)[-1500:],flush=True)
