/* Input of bindgen (build.rs) for the verbs bindings.
 *
 * libibverbs is loaded at run time (dlopen), so nothing generated from this header may make
 * the wrapper object reference an exported libibverbs symbol at link time. The static inline
 * verbs wrapped by build.rs are therefore only those that call through the provider's ops
 * tables (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) plus the helper
 * below; exported functions are looked up with dlsym (see sys.rs). */
#include <infiniband/verbs.h>

/* ibv_query_port is a macro over a static inline that falls back to the exported
 * (compat) ibv_query_port symbol when the provider has no extended query_port op. This
 * variant only uses the ops table and returns -1 where that fallback is needed; the caller
 * then calls the dlsym'd compat symbol itself. Other failures return a positive errno. */
static inline int hoccl_ibv_query_port_ex(struct ibv_context *context, uint8_t port_num,
					  struct ibv_port_attr *port_attr)
{
	struct verbs_context *vctx = verbs_get_ctx_op(context, query_port);

	if (!vctx)
		return -1;
	return vctx->query_port(context, port_num, port_attr, sizeof(*port_attr));
}
